"""Compiler: dataflow graph, fusion and scheduling."""
