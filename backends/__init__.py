"""Backends: kernel descriptors, CUTLASS code generation and build, numpy reference."""
