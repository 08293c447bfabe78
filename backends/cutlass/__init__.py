"""CUTLASS backend: emit C++ through the CUTLASS Python interface and compile with nvcc."""
