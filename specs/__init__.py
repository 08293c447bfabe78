"""Shipped example specs."""
