"""Lowering: compiler `KernelPlan`s -> backend kernel descriptors (backends/desc.py)."""
from __future__ import annotations


def attention_veto(archs):
    """A callback for the fusion pass: the reason fused attention cannot be used on every arch in
    `archs`, or None when it can."""
    def check(info):
        return None
    return check
