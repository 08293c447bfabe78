"""The dataflow graph and its canonicalisation: structure of every shipped spec, validate()'s
invariants, copy/constant/CSE/dead-code passes and GEMM recognition (operand layouts)."""
from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest

from kspec.compiler import GemmInfo, OpNode, build_graph, canonicalize, gemm_info, op, operands, validate
from kspec.compiler.canon import fold_constants, merge_common_subexpressions, remove_copies, remove_dead
from kspec.spec_lang import KspecInternalError, load_spec

SPECS = Path(__file__).resolve().parent.parent / "specs"


def kernel_of(src: str):
    return load_spec(src, is_text=True).kernels[0]


def graph_of(src: str, canon: bool = True) -> nx.DiGraph:
    g = build_graph(kernel_of(src))
    if canon:
        canonicalize(g)
        validate(g)
    return g


def ordered(g) -> list:
    return sorted(g.nodes, key=lambda n: int(str(n)[1:]))


def labels(g) -> list[str]:
    return [op(g, n).label() for n in ordered(g)]


def only(g, kind: str, fn: str | None = None):
    found = [n for n in g.nodes if op(g, n).kind == kind and (fn is None or op(g, n).fn == fn)]
    assert len(found) == 1, (kind, fn, labels(g))
    return found[0]


# ---------------------------------------------------------------- shipped specs

# After canonicalisation: nodes in creation order as (label, shape), and edges as
# (producer index, consumer index, uses) with uses = ((operand position, labels), ...).
SHIPPED = {
    "attention": (
        [("param scale : f32", ()),
         ("input Q[d0, d1, d2, d3] : f16", ('B', 'H', 'S', 128)),
         ("input K[d0, d1, d2, d3] : f16", ('B', 'H', 'T', 128)),
         ("input V[d0, d1, d2, d3] : f16", ('B', 'H', 'T', 128)),
         ("contraction sum(e)[b, h, i, j] : f32", ('B', 'H', 'S', 'T')),
         ("elementwise mul[b, h, i, j] : f32 =s", ('B', 'H', 'S', 'T')),
         ("softmax(j)[b, h, i, j] : f32", ('B', 'H', 'S', 'T')),
         ("contraction sum(j)[b, h, i, e] : f32", ('B', 'H', 'S', 128)),
         ("cast cast:f16[b, h, i, e] : f16 =O", ('B', 'H', 'S', 128)),
         ("output O[d0, d1, d2, d3] : f16", ('B', 'H', 'S', 128))],
        [(0, 5, ((0, ()),)),
         (1, 4, ((0, ('b', 'h', 'i', 'e')),)),
         (2, 4, ((1, ('b', 'h', 'j', 'e')),)),
         (3, 7, ((1, ('b', 'h', 'j', 'e')),)),
         (4, 5, ((1, ('b', 'h', 'i', 'j')),)),
         (5, 6, ((0, ('b', 'h', 'i', 'j')),)),
         (6, 7, ((0, ('b', 'h', 'i', 'j')),)),
         (7, 8, ((0, ('b', 'h', 'i', 'e')),)),
         (8, 9, ((0, ('b', 'h', 'i', 'e')),))]),
    "attention_causal": (
        [("param scale : f32", ()),
         ("input Q[d0, d1, d2, d3] : bf16", ('B', 'H', 'S', 64)),
         ("input K[d0, d1, d2, d3] : bf16", ('B', 'H', 'S', 64)),
         ("input V[d0, d1, d2, d3] : bf16", ('B', 'H', 'S', 64)),
         ("contraction sum(e)[b, h, i, j] : f32", ('B', 'H', 'S', 'S')),
         ("elementwise mul[b, h, i, j] : f32 =s", ('B', 'H', 'S', 'S')),
         ("softmax(j, causal=i)[b, h, i, j] : f32", ('B', 'H', 'S', 'S')),
         ("contraction sum(j)[b, h, i, e] : f32", ('B', 'H', 'S', 64)),
         ("cast cast:bf16[b, h, i, e] : bf16 =O", ('B', 'H', 'S', 64)),
         ("output O[d0, d1, d2, d3] : bf16", ('B', 'H', 'S', 64))],
        [(0, 5, ((0, ()),)),
         (1, 4, ((0, ('b', 'h', 'i', 'e')),)),
         (2, 4, ((1, ('b', 'h', 'j', 'e')),)),
         (3, 7, ((1, ('b', 'h', 'j', 'e')),)),
         (4, 5, ((1, ('b', 'h', 'i', 'j')),)),
         (5, 6, ((0, ('b', 'h', 'i', 'j')),)),
         (6, 7, ((0, ('b', 'h', 'i', 'j')),)),
         (7, 8, ((0, ('b', 'h', 'i', 'e')),)),
         (8, 9, ((0, ('b', 'h', 'i', 'e')),))]),
    "batched_gemm": (
        [("input A[d0, d1, d2] : bf16", ('L', 'M', 'K')),
         ("input B[d0, d1, d2] : bf16", ('L', 'K', 'N')),
         ("contraction sum(k)[b, m, n] : f32", ('L', 'M', 'N')),
         ("cast cast:bf16[b, m, n] : bf16 =C", ('L', 'M', 'N')),
         ("output C[d0, d1, d2] : bf16", ('L', 'M', 'N'))],
        [(0, 2, ((0, ('b', 'm', 'k')),)),
         (1, 2, ((1, ('b', 'k', 'n')),)),
         (2, 3, ((0, ('b', 'm', 'n')),)),
         (3, 4, ((0, ('b', 'm', 'n')),))]),
    "fp8_gemm_scaled": (
        [("param scale_a : f32", ()),
         ("param scale_b : f32", ()),
         ("input A[d0, d1] : f8e4m3", ('M', 'K')),
         ("input B[d0, d1] : f8e4m3", ('K', 'N')),
         ("contraction sum(k)[m, n] : f32", ('M', 'N')),
         ("elementwise mul : f32", ()),
         ("elementwise mul[m, n] : f32", ('M', 'N')),
         ("cast cast:bf16[m, n] : bf16 =D", ('M', 'N')),
         ("output D[d0, d1] : bf16", ('M', 'N'))],
        [(0, 5, ((0, ()),)),
         (1, 5, ((1, ()),)),
         (2, 4, ((0, ('m', 'k')),)),
         (3, 4, ((1, ('k', 'n')),)),
         (4, 6, ((1, ('m', 'n')),)),
         (5, 6, ((0, ()),)),
         (6, 7, ((0, ('m', 'n')),)),
         (7, 8, ((0, ('m', 'n')),))]),
    "gemm": (
        [("input A[d0, d1] : f16", ('M', 'K')),
         ("input B[d0, d1] : f16", ('K', 'N')),
         ("contraction sum(k)[m, n] : f32", ('M', 'N')),
         ("cast cast:f16[m, n] : f16 =D", ('M', 'N')),
         ("output D[d0, d1] : f16", ('M', 'N'))],
        [(0, 2, ((0, ('m', 'k')),)),
         (1, 2, ((1, ('k', 'n')),)),
         (2, 3, ((0, ('m', 'n')),)),
         (3, 4, ((0, ('m', 'n')),))]),
    "gemm_bias_gelu_residual": (
        [("param alpha : f32", ()),
         ("input A[d0, d1] : f16", ('M', 'K')),
         ("input B[d0, d1] : f16", ('K', 'N')),
         ("input bias[d0] : f16", ('N',)),
         ("input R[d0, d1] : f16", ('M', 'N')),
         ("contraction sum(k)[m, n] : f32", ('M', 'N')),
         ("elementwise mul[m, n] : f32", ('M', 'N')),
         ("broadcast broadcast[m, n] : f16", ('M', 'N')),
         ("elementwise add[m, n] : f32", ('M', 'N')),
         ("elementwise gelu[m, n] : f32 =h", ('M', 'N')),
         ("elementwise add[m, n] : f32", ('M', 'N')),
         ("cast cast:f16[m, n] : f16 =D", ('M', 'N')),
         ("output D[d0, d1] : f16", ('M', 'N'))],
        [(0, 6, ((0, ()),)),
         (1, 5, ((0, ('m', 'k')),)),
         (2, 5, ((1, ('k', 'n')),)),
         (3, 7, ((0, ('n',)),)),
         (4, 10, ((1, ('m', 'n')),)),
         (5, 6, ((1, ('m', 'n')),)),
         (6, 8, ((0, ('m', 'n')),)),
         (7, 8, ((1, ('m', 'n')),)),
         (8, 9, ((0, ('m', 'n')),)),
         (9, 10, ((0, ('m', 'n')),)),
         (10, 11, ((0, ('m', 'n')),)),
         (11, 12, ((0, ('m', 'n')),))]),
    "gemm_bias_relu": (
        [("input A[d0, d1] : f16", ('M', 'K')),
         ("input B[d0, d1] : f16", ('K', 'N')),
         ("input bias[d0] : f16", ('N',)),
         ("contraction sum(k)[m, n] : f32", ('M', 'N')),
         ("broadcast broadcast[m, n] : f16", ('M', 'N')),
         ("elementwise add[m, n] : f32", ('M', 'N')),
         ("elementwise relu[m, n] : f32", ('M', 'N')),
         ("cast cast:f16[m, n] : f16 =D", ('M', 'N')),
         ("output D[d0, d1] : f16", ('M', 'N'))],
        [(0, 3, ((0, ('m', 'k')),)),
         (1, 3, ((1, ('k', 'n')),)),
         (2, 4, ((0, ('n',)),)),
         (3, 5, ((0, ('m', 'n')),)),
         (4, 5, ((1, ('m', 'n')),)),
         (5, 6, ((0, ('m', 'n')),)),
         (6, 7, ((0, ('m', 'n')),)),
         (7, 8, ((0, ('m', 'n')),))]),
    "gemm_rowmax": (
        [("input A[d0, d1] : f16", ('M', 'K')),
         ("input B[d0, d1] : f16", ('K', 'N')),
         ("input bias[d0] : f32", ('N',)),
         ("contraction sum(k)[m, n] : f32", ('M', 'N')),
         ("broadcast broadcast[m, n] : f32", ('M', 'N')),
         ("elementwise add[m, n] : f32 =y", ('M', 'N')),
         ("cast cast:f16[m, n] : f16 =D", ('M', 'N')),
         ("output D[d0, d1] : f16", ('M', 'N')),
         ("reduction max(n)[m] : f32", ('M',)),
         ("output rowmax[d0] : f32", ('M',))],
        [(0, 3, ((0, ('m', 'k')),)),
         (1, 3, ((1, ('k', 'n')),)),
         (2, 4, ((0, ('n',)),)),
         (3, 5, ((0, ('m', 'n')),)),
         (4, 5, ((1, ('m', 'n')),)),
         (5, 6, ((0, ('m', 'n')),)),
         (5, 8, ((0, ('m', 'n')),)),
         (6, 7, ((0, ('m', 'n')),)),
         (8, 9, ((0, ('m',)),))]),
    "fp8_gemm_cast_bias": (
        [('param scale_a : f32', ()),
         ('param scale_b : f32', ()),
         ('input A[d0, d1] : f8e4m3', ('M', 'K')),
         ('input B[d0, d1] : f8e4m3', ('N', 'K')),
         ('input bias[d0] : bf16', ('N',)),
         ('contraction sum(k)[m, n] : f32', ('M', 'N')),
         ('elementwise mul : f32', ()),
         ('elementwise mul[m, n] : f32', ('M', 'N')),
         ('cast cast:f32[n] : f32', ('N',)),
         ('broadcast broadcast[m, n] : f32', ('M', 'N')),
         ('elementwise add[m, n] : f32', ('M', 'N')),
         ('cast cast:bf16[m, n] : bf16 =D', ('M', 'N')),
         ('output D[d0, d1] : bf16', ('M', 'N'))],
        [(0, 6, ((0, ()),)),
         (1, 6, ((1, ()),)),
         (2, 5, ((0, ('m', 'k')),)),
         (3, 5, ((1, ('n', 'k')),)),
         (4, 8, ((0, ('n',)),)),
         (5, 7, ((1, ('m', 'n')),)),
         (6, 7, ((0, ()),)),
         (7, 10, ((0, ('m', 'n')),)),
         (8, 9, ((0, ('n',)),)),
         (9, 10, ((1, ('m', 'n')),)),
         (10, 11, ((0, ('m', 'n')),)),
         (11, 12, ((0, ('m', 'n')),))]),
    "linear_shared_weight": (
        [('input X[d0, d1, d2] : f16', ('B', 'S', 'K')),
         ('input W[d0, d1] : f16', ('N', 'K')),
         ('input bias[d0] : f16', ('N',)),
         ('contraction sum(k)[b, s, n] : f32', ('B', 'S', 'N')),
         ('broadcast broadcast[b, s, n] : f16', ('B', 'S', 'N')),
         ('elementwise add[b, s, n] : f32', ('B', 'S', 'N')),
         ('cast cast:f16[b, s, n] : f16 =Y', ('B', 'S', 'N')),
         ('output Y[d0, d1, d2] : f16', ('B', 'S', 'N'))],
        [(0, 3, ((0, ('b', 's', 'k')),)),
         (1, 3, ((1, ('n', 'k')),)),
         (2, 4, ((0, ('n',)),)),
         (3, 5, ((0, ('b', 's', 'n')),)),
         (4, 5, ((1, ('b', 's', 'n')),)),
         (5, 6, ((0, ('b', 's', 'n')),)),
         (6, 7, ((0, ('b', 's', 'n')),))]),
    "mlp2": (
        [('input X[d0, d1] : f16', ('M', 'K')),
         ('input W1[d0, d1] : f16', ('F', 'K')),
         ('input W2[d0, d1] : f16', ('N', 'F')),
         ('const 0.5', ()),
         ('contraction sum(k)[m, f] : f32', ('M', 'F')),
         ('elementwise mul[m, f] : f32', ('M', 'F')),
         ('elementwise gelu_tanh[m, f] : f32', ('M', 'F')),
         ('cast cast:f16[m, f] : f16 =h', ('M', 'F')),
         ('contraction sum(f)[m, n] : f32', ('M', 'N')),
         ('cast cast:f16[m, n] : f16 =Y', ('M', 'N')),
         ('output Y[d0, d1] : f16', ('M', 'N'))],
        [(0, 4, ((0, ('m', 'k')),)),
         (1, 4, ((1, ('f', 'k')),)),
         (2, 8, ((1, ('n', 'f')),)),
         (3, 5, ((0, ()),)),
         (4, 5, ((1, ('m', 'f')),)),
         (5, 6, ((0, ('m', 'f')),)),
         (6, 7, ((0, ('m', 'f')),)),
         (7, 8, ((0, ('m', 'f')),)),
         (8, 9, ((0, ('m', 'n')),)),
         (9, 10, ((0, ('m', 'n')),))]),
    "swiglu_mlp": (
        [('input X[d0, d1] : f16', ('M', 'K')),
         ('input Wg[d0, d1] : f16', ('F', 'K')),
         ('input Wu[d0, d1] : f16', ('F', 'K')),
         ('input Wd[d0, d1] : f16', ('N', 'F')),
         ('contraction sum(k)[m, f] : f32', ('M', 'F')),
         ('elementwise silu[m, f] : f32', ('M', 'F')),
         ('contraction sum(k)[m, f] : f32', ('M', 'F')),
         ('elementwise mul[m, f] : f32', ('M', 'F')),
         ('cast cast:f16[m, f] : f16 =h', ('M', 'F')),
         ('contraction sum(f)[m, n] : f32', ('M', 'N')),
         ('cast cast:f16[m, n] : f16 =Y', ('M', 'N')),
         ('output Y[d0, d1] : f16', ('M', 'N'))],
        [(0, 4, ((0, ('m', 'k')),)),
         (0, 6, ((0, ('m', 'k')),)),
         (1, 4, ((1, ('f', 'k')),)),
         (2, 6, ((1, ('f', 'k')),)),
         (3, 9, ((1, ('n', 'f')),)),
         (4, 5, ((0, ('m', 'f')),)),
         (5, 7, ((0, ('m', 'f')),)),
         (6, 7, ((1, ('m', 'f')),)),
         (7, 8, ((0, ('m', 'f')),)),
         (8, 9, ((0, ('m', 'f')),)),
         (9, 10, ((0, ('m', 'n')),)),
         (10, 11, ((0, ('m', 'n')),))]),
    "add_rmsnorm": (
        [('param eps : f32', ()),
         ('input x[d0, d1] : bf16', ('M', 'N')),
         ('input res[d0, d1] : bf16', ('M', 'N')),
         ('input w[d0] : bf16', ('N',)),
         ('elementwise add[m, n] : bf16 =h', ('M', 'N')),
         ('output h[d0, d1] : bf16', ('M', 'N')),
         ('cast cast:f32[m, n] : f32', ('M', 'N')),
         ('elementwise mul[m, n] : f32', ('M', 'N')),
         ('reduction mean(n)[m] : f32', ('M',)),
         ('elementwise add[m] : f32', ('M',)),
         ('elementwise rsqrt[m] : f32', ('M',)),
         ('broadcast broadcast[m, n] : f32', ('M', 'N')),
         ('elementwise mul[m, n] : f32', ('M', 'N')),
         ('cast cast:f32[n] : f32', ('N',)),
         ('broadcast broadcast[m, n] : f32', ('M', 'N')),
         ('elementwise mul[m, n] : f32', ('M', 'N')),
         ('cast cast:bf16[m, n] : bf16 =y', ('M', 'N')),
         ('output y[d0, d1] : bf16', ('M', 'N')),
         ('cast cast:f32[m, n] : f32', ('M', 'N'))],
        [(0, 9, ((1, ()),)),
         (1, 4, ((0, ('m', 'n')),)),
         (2, 4, ((1, ('m', 'n')),)),
         (3, 13, ((0, ('n',)),)),
         (4, 5, ((0, ('m', 'n')),)),
         (4, 6, ((0, ('m', 'n')),)),
         (4, 18, ((0, ('m', 'n')),)),
         (6, 12, ((0, ('m', 'n')),)),
         (7, 8, ((0, ('m', 'n')),)),
         (8, 9, ((0, ('m',)),)),
         (9, 10, ((0, ('m',)),)),
         (10, 11, ((0, ('m',)),)),
         (11, 12, ((1, ('m', 'n')),)),
         (12, 15, ((0, ('m', 'n')),)),
         (13, 14, ((0, ('n',)),)),
         (14, 15, ((1, ('m', 'n')),)),
         (15, 16, ((0, ('m', 'n')),)),
         (16, 17, ((0, ('m', 'n')),)),
         (18, 7, ((0, ('m', 'n')), (1, ('m', 'n'))))]),
    "rope": (
        [('input Q[d0, d1, d2, d3] : bf16', ('B', 'S', 'H', 128)),
         ('input cos[d0, d1] : f32', ('S', 128)),
         ('input sin[d0, d1] : f32', ('S', 128)),
         ('cast cast:f32[b, s, h, e] : f32', ('B', 'S', 'H', 128)),
         ('broadcast broadcast[b, s, h, e] : f32', ('B', 'S', 'H', 128)),
         ('elementwise mul[b, s, h, e] : f32', ('B', 'S', 'H', 128)),
         ('index e[e] : i32', (128,)),
         ('const 64', ()),
         ('elementwise lt[e] : bool', (128,)),
         ('broadcast broadcast[e, b, s, h] : bool', (128, 'B', 'S', 'H')),
         ('elementwise add[e] : i32', (128,)),
         ('const 128', ()),
         ('elementwise mod[e] : i32', (128,)),
         ('gather [b, s, h, @1][b, s, h, e] : bf16', ('B', 'S', 'H', 128)),
         ('cast cast:f32[b, s, h, e] : f32', ('B', 'S', 'H', 128)),
         ('elementwise neg[b, s, h, e] : f32', ('B', 'S', 'H', 128)),
         ('elementwise where[e, b, s, h] : f32', (128, 'B', 'S', 'H')),
         ('broadcast broadcast[e, b, s, h] : f32', (128, 'B', 'S', 'H')),
         ('elementwise mul[e, b, s, h] : f32', (128, 'B', 'S', 'H')),
         ('elementwise add[b, s, h, e] : f32', ('B', 'S', 'H', 128)),
         ('cast cast:bf16[b, s, h, e] : bf16 =Y', ('B', 'S', 'H', 128)),
         ('output Y[d0, d1, d2, d3] : bf16', ('B', 'S', 'H', 128)),
         ('cast cast:f32[b, s, h, e] : f32', ('B', 'S', 'H', 128)),
         ('const 64', ()),
         ('index e[e] : i32', (128,))],
        [(0, 3, ((0, ('b', 's', 'h', 'e')),)),
         (0, 13, ((0, ('b', 's', 'h', '~3')),)),
         (1, 4, ((0, ('s', 'e')),)),
         (2, 17, ((0, ('s', 'e')),)),
         (3, 5, ((0, ('b', 's', 'h', 'e')),)),
         (4, 5, ((1, ('b', 's', 'h', 'e')),)),
         (5, 19, ((0, ('b', 's', 'h', 'e')),)),
         (6, 10, ((0, ('e',)),)),
         (7, 10, ((1, ()),)),
         (8, 9, ((0, ('e',)),)),
         (9, 16, ((0, ('e', 'b', 's', 'h')),)),
         (10, 12, ((0, ('e',)),)),
         (11, 12, ((1, ()),)),
         (12, 13, ((1, ('e',)),)),
         (13, 14, ((0, ('b', 's', 'h', 'e')),)),
         (13, 22, ((0, ('b', 's', 'h', 'e')),)),
         (14, 15, ((0, ('b', 's', 'h', 'e')),)),
         (15, 16, ((1, ('b', 's', 'h', 'e')),)),
         (16, 18, ((0, ('e', 'b', 's', 'h')),)),
         (17, 18, ((1, ('e', 'b', 's', 'h')),)),
         (18, 19, ((1, ('e', 'b', 's', 'h')),)),
         (19, 20, ((0, ('b', 's', 'h', 'e')),)),
         (20, 21, ((0, ('b', 's', 'h', 'e')),)),
         (22, 16, ((2, ('b', 's', 'h', 'e')),)),
         (23, 8, ((1, ()),)),
         (24, 8, ((0, ('e',)),))]),
    "cross_entropy": (
        [('input logits[d0, d1] : bf16', ('M', 'V')),
         ('input label[d0] : i32', ('M',)),
         ('cast cast:f32[m, v] : f32', ('M', 'V')),
         ('reduction max(v)[m] : f32', ('M',)),
         ('broadcast broadcast[m, v] : f32', ('M', 'V')),
         ('elementwise sub[m, v] : f32', ('M', 'V')),
         ('elementwise exp[m, v] : f32', ('M', 'V')),
         ('reduction sum(v)[m] : f32', ('M',)),
         ('elementwise log[m] : f32', ('M',)),
         ('elementwise add[m] : f32 =lse', ('M',)),
         ('gather [m, @1][m] : bf16', ('M',)),
         ('cast cast:f32[m] : f32', ('M',)),
         ('elementwise sub[m] : f32 =loss', ('M',)),
         ('output loss[d0] : f32', ('M',)),
         ('cast cast:f32[m, v] : f32', ('M', 'V'))],
        [(0, 2, ((0, ('m', 'v')),)),
         (0, 10, ((0, ('m', '~1')),)),
         (0, 14, ((0, ('m', 'v')),)),
         (1, 10, ((1, ('m',)),)),
         (2, 3, ((0, ('m', 'v')),)),
         (3, 4, ((0, ('m',)),)),
         (3, 9, ((1, ('m',)),)),
         (4, 5, ((1, ('m', 'v')),)),
         (5, 6, ((0, ('m', 'v')),)),
         (6, 7, ((0, ('m', 'v')),)),
         (7, 8, ((0, ('m',)),)),
         (8, 9, ((0, ('m',)),)),
         (9, 12, ((0, ('m',)),)),
         (10, 11, ((0, ('m',)),)),
         (11, 12, ((1, ('m',)),)),
         (12, 13, ((0, ('m',)),)),
         (14, 5, ((0, ('m', 'v')),))]),
    "layernorm": (
        [('param eps : f32', ()),
         ('input x[d0, d1] : bf16', ('M', 'N')),
         ('input gamma[d0] : bf16', ('N',)),
         ('input beta[d0] : bf16', ('N',)),
         ('cast cast:f32[m, n] : f32', ('M', 'N')),
         ('reduction mean(n)[m] : f32', ('M',)),
         ('broadcast broadcast[m, n] : f32', ('M', 'N')),
         ('elementwise sub[m, n] : f32 =xc', ('M', 'N')),
         ('elementwise mul[m, n] : f32', ('M', 'N')),
         ('reduction mean(n)[m] : f32', ('M',)),
         ('elementwise add[m] : f32', ('M',)),
         ('elementwise rsqrt[m] : f32', ('M',)),
         ('broadcast broadcast[m, n] : f32', ('M', 'N')),
         ('elementwise mul[m, n] : f32', ('M', 'N')),
         ('cast cast:f32[n] : f32', ('N',)),
         ('broadcast broadcast[m, n] : f32', ('M', 'N')),
         ('elementwise mul[m, n] : f32', ('M', 'N')),
         ('cast cast:f32[n] : f32', ('N',)),
         ('broadcast broadcast[m, n] : f32', ('M', 'N')),
         ('elementwise add[m, n] : f32', ('M', 'N')),
         ('cast cast:bf16[m, n] : bf16 =y', ('M', 'N')),
         ('output y[d0, d1] : bf16', ('M', 'N')),
         ('cast cast:f32[m, n] : f32', ('M', 'N')),
         ('elementwise sub[m, n] : f32', ('M', 'N')),
         ('broadcast broadcast[m, n] : f32', ('M', 'N')),
         ('cast cast:f32[m, n] : f32', ('M', 'N'))],
        [(0, 10, ((1, ()),)),
         (1, 4, ((0, ('m', 'n')),)),
         (1, 22, ((0, ('m', 'n')),)),
         (1, 25, ((0, ('m', 'n')),)),
         (2, 14, ((0, ('n',)),)),
         (3, 17, ((0, ('n',)),)),
         (4, 5, ((0, ('m', 'n')),)),
         (5, 6, ((0, ('m',)),)),
         (5, 24, ((0, ('m',)),)),
         (6, 23, ((1, ('m', 'n')),)),
         (7, 13, ((0, ('m', 'n')),)),
         (8, 9, ((0, ('m', 'n')),)),
         (9, 10, ((0, ('m',)),)),
         (10, 11, ((0, ('m',)),)),
         (11, 12, ((0, ('m',)),)),
         (12, 13, ((1, ('m', 'n')),)),
         (13, 16, ((0, ('m', 'n')),)),
         (14, 15, ((0, ('n',)),)),
         (15, 16, ((1, ('m', 'n')),)),
         (16, 19, ((0, ('m', 'n')),)),
         (17, 18, ((0, ('n',)),)),
         (18, 19, ((1, ('m', 'n')),)),
         (19, 20, ((0, ('m', 'n')),)),
         (20, 21, ((0, ('m', 'n')),)),
         (22, 23, ((0, ('m', 'n')),)),
         (23, 8, ((0, ('m', 'n')), (1, ('m', 'n')))),
         (24, 7, ((1, ('m', 'n')),)),
         (25, 7, ((0, ('m', 'n')),))]),
    "rmsnorm": (
        [('param eps : f32', ()),
         ('input x[d0, d1] : bf16', ('M', 'N')),
         ('input w[d0] : bf16', ('N',)),
         ('cast cast:f32[m, n] : f32', ('M', 'N')),
         ('elementwise mul[m, n] : f32', ('M', 'N')),
         ('reduction mean(n)[m] : f32', ('M',)),
         ('elementwise add[m] : f32', ('M',)),
         ('elementwise rsqrt[m] : f32', ('M',)),
         ('broadcast broadcast[m, n] : f32', ('M', 'N')),
         ('elementwise mul[m, n] : f32', ('M', 'N')),
         ('cast cast:f32[n] : f32', ('N',)),
         ('broadcast broadcast[m, n] : f32', ('M', 'N')),
         ('elementwise mul[m, n] : f32', ('M', 'N')),
         ('cast cast:bf16[m, n] : bf16 =y', ('M', 'N')),
         ('output y[d0, d1] : bf16', ('M', 'N')),
         ('cast cast:f32[m, n] : f32', ('M', 'N'))],
        [(0, 6, ((1, ()),)),
         (1, 3, ((0, ('m', 'n')),)),
         (1, 15, ((0, ('m', 'n')),)),
         (2, 10, ((0, ('n',)),)),
         (3, 9, ((0, ('m', 'n')),)),
         (4, 5, ((0, ('m', 'n')),)),
         (5, 6, ((0, ('m',)),)),
         (6, 7, ((0, ('m',)),)),
         (7, 8, ((0, ('m',)),)),
         (8, 9, ((1, ('m', 'n')),)),
         (9, 12, ((0, ('m', 'n')),)),
         (10, 11, ((0, ('n',)),)),
         (11, 12, ((1, ('m', 'n')),)),
         (12, 13, ((0, ('m', 'n')),)),
         (13, 14, ((0, ('m', 'n')),)),
         (15, 4, ((0, ('m', 'n')), (1, ('m', 'n'))))]),
    "row_softmax": (
        [('input x[d0, d1] : bf16', ('M', 'N')),
         ('softmax(n)[m, n] : f32', ('M', 'N')),
         ('cast cast:bf16[m, n] : bf16 =y', ('M', 'N')),
         ('output y[d0, d1] : bf16', ('M', 'N'))],
        [(0, 1, ((0, ('m', 'n')),)),
         (1, 2, ((0, ('m', 'n')),)),
         (2, 3, ((0, ('m', 'n')),))]),
    "gemm_int8": (
        [('input A[d0, d1] : i8', ('M', 'K')),
         ('input B[d0, d1] : i8', ('K', 'N')),
         ('contraction sum(k)[m, n] : i32', ('M', 'N')),
         ('output D[d0, d1] : i32', ('M', 'N'))],
        [(0, 2, ((0, ('m', 'k')),)),
         (1, 2, ((1, ('k', 'n')),)),
         (2, 3, ((0, ('m', 'n')),))]),
    "gemm_tf32": (
        [('input A[d0, d1] : tf32', ('M', 'K')),
         ('input B[d0, d1] : tf32', ('K', 'N')),
         ('contraction sum(k)[m, n] : f32', ('M', 'N')),
         ('output D[d0, d1] : f32', ('M', 'N'))],
        [(0, 2, ((0, ('m', 'k')),)),
         (1, 2, ((1, ('k', 'n')),)),
         (2, 3, ((0, ('m', 'n')),))]),
    "batched_gemm_shared_b": (
        [('input A[d0, d1, d2] : bf16', ('L', 'M', 'K')),
         ('input B[d0, d1] : bf16', ('N', 'K')),
         ('contraction sum(k)[l, m, n] : f32', ('L', 'M', 'N')),
         ('cast cast:bf16[l, m, n] : bf16 =C', ('L', 'M', 'N')),
         ('output C[d0, d1, d2] : bf16', ('L', 'M', 'N'))],
        [(0, 2, ((0, ('l', 'm', 'k')),)),
         (1, 2, ((1, ('n', 'k')),)),
         (2, 3, ((0, ('l', 'm', 'n')),)),
         (3, 4, ((0, ('l', 'm', 'n')),))]),
    "attention_lse": (
        [('param scale : f32', ()),
         ('input Q[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 128)),
         ('input K[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 128)),
         ('input V[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 128)),
         ('contraction sum(e)[b, h, i, j] : f32', ('B', 'H', 'S', 'S')),
         ('elementwise mul[b, h, i, j] : f32 =s', ('B', 'H', 'S', 'S')),
         ('index j[j] : i32', ('S',)),
         ('broadcast broadcast[j, i] : i32', ('S', 'S')),
         ('index i[i] : i32', ('S',)),
         ('broadcast broadcast[j, i] : i32', ('S', 'S')),
         ('elementwise le[j, i] : bool', ('S', 'S')),
         ('broadcast broadcast[j, i, b, h] : bool', ('S', 'S', 'B', 'H')),
         ('const -inf', ()),
         ('elementwise where[b, h, i, j] : f32 =m', ('B', 'H', 'S', 'S')),
         ('softmax(j)[b, h, i, j] : f32', ('B', 'H', 'S', 'S')),
         ('contraction sum(j)[b, h, i, e] : f32', ('B', 'H', 'S', 128)),
         ('cast cast:bf16[b, h, i, e] : bf16 =O', ('B', 'H', 'S', 128)),
         ('output O[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 128)),
         ('reduction logsumexp(j)[b, h, i] : f32', ('B', 'H', 'S')),
         ('output L[d0, d1, d2] : f32', ('B', 'H', 'S'))],
        [(0, 5, ((0, ()),)),
         (1, 4, ((0, ('b', 'h', 'i', 'e')),)),
         (2, 4, ((1, ('b', 'h', 'j', 'e')),)),
         (3, 15, ((1, ('b', 'h', 'j', 'e')),)),
         (4, 5, ((1, ('b', 'h', 'i', 'j')),)),
         (5, 13, ((1, ('b', 'h', 'i', 'j')),)),
         (6, 7, ((0, ('j',)),)),
         (7, 10, ((0, ('j', 'i')),)),
         (8, 9, ((0, ('i',)),)),
         (9, 10, ((1, ('j', 'i')),)),
         (10, 11, ((0, ('j', 'i')),)),
         (11, 13, ((0, ('j', 'i', 'b', 'h')),)),
         (12, 13, ((2, ()),)),
         (13, 14, ((0, ('b', 'h', 'i', 'j')),)),
         (13, 18, ((0, ('b', 'h', 'i', 'j')),)),
         (14, 15, ((0, ('b', 'h', 'i', 'j')),)),
         (15, 16, ((0, ('b', 'h', 'i', 'e')),)),
         (16, 17, ((0, ('b', 'h', 'i', 'e')),)),
         (18, 19, ((0, ('b', 'h', 'i')),))]),
    "attention_alibi": (
        [('param scale : f32', ()),
         ('input Q[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 64)),
         ('input K[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 64)),
         ('input V[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 64)),
         ('input slope[d0] : f32', ('H',)),
         ('contraction sum(e)[b, h, i, j] : f32', ('B', 'H', 'S', 'S')),
         ('elementwise mul[b, h, i, j] : f32', ('B', 'H', 'S', 'S')),
         ('broadcast broadcast[h, j, i] : f32', ('H', 'S', 'S')),
         ('index j[j] : i32', ('S',)),
         ('broadcast broadcast[j, i] : i32', ('S', 'S')),
         ('index i[i] : i32', ('S',)),
         ('broadcast broadcast[j, i] : i32', ('S', 'S')),
         ('elementwise sub[j, i] : i32', ('S', 'S')),
         ('cast cast:f32[j, i] : f32', ('S', 'S')),
         ('broadcast broadcast[h, j, i] : f32', ('H', 'S', 'S')),
         ('elementwise mul[h, j, i] : f32', ('H', 'S', 'S')),
         ('broadcast broadcast[b, h, i, j] : f32', ('B', 'H', 'S', 'S')),
         ('elementwise add[b, h, i, j] : f32 =s', ('B', 'H', 'S', 'S')),
         ('elementwise le[j, i] : bool', ('S', 'S')),
         ('broadcast broadcast[j, i, b, h] : bool', ('S', 'S', 'B', 'H')),
         ('const -inf', ()),
         ('elementwise where[b, h, i, j] : f32 =m', ('B', 'H', 'S', 'S')),
         ('softmax(j)[b, h, i, j] : f32', ('B', 'H', 'S', 'S')),
         ('contraction sum(j)[b, h, i, e] : f32', ('B', 'H', 'S', 64)),
         ('cast cast:bf16[b, h, i, e] : bf16 =O', ('B', 'H', 'S', 64)),
         ('output O[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 64)),
         ('broadcast broadcast[j, i] : i32', ('S', 'S')),
         ('broadcast broadcast[j, i] : i32', ('S', 'S')),
         ('index i[i] : i32', ('S',)),
         ('index j[j] : i32', ('S',))],
        [(0, 6, ((0, ()),)),
         (1, 5, ((0, ('b', 'h', 'i', 'e')),)),
         (2, 5, ((1, ('b', 'h', 'j', 'e')),)),
         (3, 23, ((1, ('b', 'h', 'j', 'e')),)),
         (4, 7, ((0, ('h',)),)),
         (5, 6, ((1, ('b', 'h', 'i', 'j')),)),
         (6, 17, ((0, ('b', 'h', 'i', 'j')),)),
         (7, 15, ((0, ('h', 'j', 'i')),)),
         (8, 27, ((0, ('j',)),)),
         (9, 12, ((0, ('j', 'i')),)),
         (10, 11, ((0, ('i',)),)),
         (11, 12, ((1, ('j', 'i')),)),
         (12, 13, ((0, ('j', 'i')),)),
         (13, 14, ((0, ('j', 'i')),)),
         (14, 15, ((1, ('h', 'j', 'i')),)),
         (15, 16, ((0, ('h', 'j', 'i')),)),
         (16, 17, ((1, ('b', 'h', 'i', 'j')),)),
         (17, 21, ((1, ('b', 'h', 'i', 'j')),)),
         (18, 19, ((0, ('j', 'i')),)),
         (19, 21, ((0, ('j', 'i', 'b', 'h')),)),
         (20, 21, ((2, ()),)),
         (21, 22, ((0, ('b', 'h', 'i', 'j')),)),
         (22, 23, ((0, ('b', 'h', 'i', 'j')),)),
         (23, 24, ((0, ('b', 'h', 'i', 'e')),)),
         (24, 25, ((0, ('b', 'h', 'i', 'e')),)),
         (26, 18, ((1, ('j', 'i')),)),
         (27, 18, ((0, ('j', 'i')),)),
         (28, 26, ((0, ('i',)),)),
         (29, 9, ((0, ('j',)),))]),
    "attention_bias": (
        [('param scale : f32', ()),
         ('input Q[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 128)),
         ('input K[d0, d1, d2, d3] : bf16', ('B', 'H', 'T', 128)),
         ('input V[d0, d1, d2, d3] : bf16', ('B', 'H', 'T', 128)),
         ('input bias[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 'T')),
         ('contraction sum(e)[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('elementwise mul[b, h, i, j] : f32 =s', ('B', 'H', 'S', 'T')),
         ('elementwise add[b, h, i, j] : f32 =a', ('B', 'H', 'S', 'T')),
         ('softmax(j)[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('contraction sum(j)[b, h, i, e] : f32', ('B', 'H', 'S', 128)),
         ('cast cast:bf16[b, h, i, e] : bf16 =O', ('B', 'H', 'S', 128)),
         ('output O[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 128))],
        [(0, 6, ((0, ()),)),
         (1, 5, ((0, ('b', 'h', 'i', 'e')),)),
         (2, 5, ((1, ('b', 'h', 'j', 'e')),)),
         (3, 9, ((1, ('b', 'h', 'j', 'e')),)),
         (4, 7, ((1, ('b', 'h', 'i', 'j')),)),
         (5, 6, ((1, ('b', 'h', 'i', 'j')),)),
         (6, 7, ((0, ('b', 'h', 'i', 'j')),)),
         (7, 8, ((0, ('b', 'h', 'i', 'j')),)),
         (8, 9, ((0, ('b', 'h', 'i', 'j')),)),
         (9, 10, ((0, ('b', 'h', 'i', 'e')),)),
         (10, 11, ((0, ('b', 'h', 'i', 'e')),))]),
    "attention_paged": (
        [('param scale : f32', ()),
         ('input Q[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 128)),
         ('input Kc[d0, d1, d2, d3] : bf16', ('NP', 'P', 'H', 128)),
         ('input Vc[d0, d1, d2, d3] : bf16', ('NP', 'P', 'H', 128)),
         ('input bt[d0, d1] : i32', ('B', 'MP')),
         ('input kv_len[d0] : i32', ('B',)),
         ('index j[j] : i32', (('MP', 'P'),)),
         ('size P : i32', ()),
         ('elementwise floordiv[j] : i32', (('MP', 'P'),)),
         ('gather [b, @1][b, j] : i32', ('B', ('MP', 'P'))),
         ('elementwise mod[j] : i32', (('MP', 'P'),)),
         ('gather [@1, @2, h, e][b, j, h, e] : bf16', ('B', ('MP', 'P'), 'H', 128)),
         ('contraction sum(e)[b, h, i, j] : f32', ('B', 'H', 'S', ('MP', 'P'))),
         ('elementwise mul[b, h, i, j] : f32 =s', ('B', 'H', 'S', ('MP', 'P'))),
         ('broadcast broadcast[j, b] : i32', (('MP', 'P'), 'B')),
         ('broadcast broadcast[j, b] : i32', (('MP', 'P'), 'B')),
         ('elementwise lt[j, b] : bool', (('MP', 'P'), 'B')),
         ('broadcast broadcast[j, b, i] : bool', (('MP', 'P'), 'B', 'S')),
         ('broadcast broadcast[j, i, b] : i32', (('MP', 'P'), 'S', 'B')),
         ('index i[i] : i32', ('S',)),
         ('broadcast broadcast[i, b] : i32', ('S', 'B')),
         ('size S : i32', ()),
         ('elementwise sub[b] : i32', ('B',)),
         ('broadcast broadcast[i, b] : i32', ('S', 'B')),
         ('elementwise add[i, b] : i32', ('S', 'B')),
         ('broadcast broadcast[j, i, b] : i32', (('MP', 'P'), 'S', 'B')),
         ('elementwise le[j, i, b] : bool', (('MP', 'P'), 'S', 'B')),
         ('elementwise and[j, b, i] : bool', (('MP', 'P'), 'B', 'S')),
         ('broadcast broadcast[j, b, i, h] : bool', (('MP', 'P'), 'B', 'S', 'H')),
         ('const -inf', ()),
         ('elementwise where[b, h, i, j] : f32 =m', ('B', 'H', 'S', ('MP', 'P'))),
         ('softmax(j)[b, h, i, j] : f32', ('B', 'H', 'S', ('MP', 'P'))),
         ('gather [@1, @2, h, e][b, j, h, e] : bf16', ('B', ('MP', 'P'), 'H', 128)),
         ('contraction sum(j)[b, h, i, e] : f32', ('B', 'H', 'S', 128)),
         ('cast cast:bf16[b, h, i, e] : bf16 =O', ('B', 'H', 'S', 128)),
         ('output O[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 128)),
         ('elementwise mod[j] : i32', (('MP', 'P'),)),
         ('size P : i32', ()),
         ('size P : i32', ()),
         ('index j[j] : i32', (('MP', 'P'),)),
         ('index j[j] : i32', (('MP', 'P'),)),
         ('index j[j] : i32', (('MP', 'P'),)),
         ('index j[j] : i32', (('MP', 'P'),))],
        [(0, 13, ((0, ()),)),
         (1, 12, ((0, ('b', 'h', 'i', 'e')),)),
         (2, 11, ((0, ('~0', '~1', 'h', 'e')),)),
         (3, 32, ((0, ('~0', '~1', 'h', 'e')),)),
         (4, 9, ((0, ('b', '~1')),)),
         (5, 15, ((0, ('b',)),)),
         (5, 22, ((0, ('b',)),)),
         (6, 10, ((0, ('j',)),)),
         (7, 10, ((1, ()),)),
         (8, 9, ((1, ('j',)),)),
         (9, 11, ((1, ('b', 'j')),)),
         (9, 32, ((1, ('b', 'j')),)),
         (10, 11, ((2, ('j',)),)),
         (11, 12, ((1, ('b', 'j', 'h', 'e')),)),
         (12, 13, ((1, ('b', 'h', 'i', 'j')),)),
         (13, 30, ((1, ('b', 'h', 'i', 'j')),)),
         (14, 16, ((0, ('j', 'b')),)),
         (15, 16, ((1, ('j', 'b')),)),
         (16, 17, ((0, ('j', 'b')),)),
         (17, 27, ((0, ('j', 'b', 'i')),)),
         (18, 26, ((0, ('j', 'i', 'b')),)),
         (19, 20, ((0, ('i',)),)),
         (20, 24, ((0, ('i', 'b')),)),
         (21, 22, ((1, ()),)),
         (22, 23, ((0, ('b',)),)),
         (23, 24, ((1, ('i', 'b')),)),
         (24, 25, ((0, ('i', 'b')),)),
         (25, 26, ((1, ('j', 'i', 'b')),)),
         (26, 27, ((1, ('j', 'i', 'b')),)),
         (27, 28, ((0, ('j', 'b', 'i')),)),
         (28, 30, ((0, ('j', 'b', 'i', 'h')),)),
         (29, 30, ((2, ()),)),
         (30, 31, ((0, ('b', 'h', 'i', 'j')),)),
         (31, 33, ((0, ('b', 'h', 'i', 'j')),)),
         (32, 33, ((1, ('b', 'j', 'h', 'e')),)),
         (33, 34, ((0, ('b', 'h', 'i', 'e')),)),
         (34, 35, ((0, ('b', 'h', 'i', 'e')),)),
         (36, 32, ((2, ('j',)),)),
         (37, 36, ((1, ()),)),
         (38, 8, ((1, ()),)),
         (39, 14, ((0, ('j',)),)),
         (40, 18, ((0, ('j',)),)),
         (41, 36, ((0, ('j',)),)),
         (42, 8, ((0, ('j',)),))]),
    "attention_varlen": (
        [('param scale : f32', ()),
         ('input cu_q[d0] : i32', ('B+1',)),
         ('input cu_k[d0] : i32', ('B+1',)),
         ('input Q[d0, d1, d2, d3] : bf16', ('B', 'S', 'H', 128)),
         ('input K[d0, d1, d2, d3] : bf16', ('B', 'T', 'H', 128)),
         ('input V[d0, d1, d2, d3] : bf16', ('B', 'T', 'H', 128)),
         ('contraction sum(e)[b, i, h, j] : f32', ('B', 'S', 'H', 'T')),
         ('elementwise mul[b, h, i, j] : f32 =s', ('B', 'H', 'S', 'T')),
         ('index j[j] : i32', ('T',)),
         ('broadcast broadcast[j, i, b] : i32', ('T', 'S', 'B')),
         ('index i[i] : i32', ('S',)),
         ('broadcast broadcast[i, b] : i32', ('S', 'B')),
         ('index b[b] : i32', ('B',)),
         ('const 1', ()),
         ('elementwise add[b] : i32', ('B',)),
         ('gather [@1][b] : i32', ('B',)),
         ('gather [b][b] : i32', ('B',)),
         ('elementwise sub[b] : i32', ('B',)),
         ('gather [@1][b] : i32', ('B',)),
         ('gather [b][b] : i32', ('B',)),
         ('elementwise sub[b] : i32', ('B',)),
         ('elementwise sub[b] : i32', ('B',)),
         ('broadcast broadcast[i, b] : i32', ('S', 'B')),
         ('elementwise add[i, b] : i32', ('S', 'B')),
         ('broadcast broadcast[j, i, b] : i32', ('T', 'S', 'B')),
         ('elementwise le[j, i, b] : bool', ('T', 'S', 'B')),
         ('broadcast broadcast[j, i, b, h] : bool', ('T', 'S', 'B', 'H')),
         ('const -inf', ()),
         ('elementwise where[b, h, i, j] : f32 =m', ('B', 'H', 'S', 'T')),
         ('broadcast broadcast[j, b] : i32', ('T', 'B')),
         ('broadcast broadcast[j, b] : i32', ('T', 'B')),
         ('elementwise lt[j, b] : bool', ('T', 'B')),
         ('broadcast broadcast[b, h, i, j] : bool', ('B', 'H', 'S', 'T')),
         ('elementwise where[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('softmax(j)[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('contraction sum(j)[b, h, i, e] : f32', ('B', 'H', 'S', 128)),
         ('cast cast:bf16[b, i, h, e] : bf16 =O', ('B', 'S', 'H', 128)),
         ('output O[d0, d1, d2, d3] : bf16', ('B', 'S', 'H', 128)),
         ('elementwise add[b] : i32', ('B',)),
         ('const -inf', ()),
         ('const 1', ()),
         ('index b[b] : i32', ('B',)),
         ('index j[j] : i32', ('T',))],
        [(0, 7, ((0, ()),)),
         (1, 18, ((0, ('~0',)),)),
         (1, 19, ((0, ('b',)),)),
         (2, 15, ((0, ('~0',)),)),
         (2, 16, ((0, ('b',)),)),
         (3, 6, ((0, ('b', 'i', 'h', 'e')),)),
         (4, 6, ((1, ('b', 'j', 'h', 'e')),)),
         (5, 35, ((1, ('b', 'j', 'h', 'e')),)),
         (6, 7, ((1, ('b', 'i', 'h', 'j')),)),
         (7, 28, ((1, ('b', 'h', 'i', 'j')),)),
         (8, 29, ((0, ('j',)),)),
         (9, 25, ((0, ('j', 'i', 'b')),)),
         (10, 11, ((0, ('i',)),)),
         (11, 23, ((0, ('i', 'b')),)),
         (12, 14, ((0, ('b',)),)),
         (13, 14, ((1, ()),)),
         (14, 15, ((1, ('b',)),)),
         (15, 17, ((0, ('b',)),)),
         (16, 17, ((1, ('b',)),)),
         (17, 21, ((0, ('b',)),)),
         (17, 30, ((0, ('b',)),)),
         (18, 20, ((0, ('b',)),)),
         (19, 20, ((1, ('b',)),)),
         (20, 21, ((1, ('b',)),)),
         (21, 22, ((0, ('b',)),)),
         (22, 23, ((1, ('i', 'b')),)),
         (23, 24, ((0, ('i', 'b')),)),
         (24, 25, ((1, ('j', 'i', 'b')),)),
         (25, 26, ((0, ('j', 'i', 'b')),)),
         (26, 28, ((0, ('j', 'i', 'b', 'h')),)),
         (27, 28, ((2, ()),)),
         (28, 33, ((1, ('b', 'h', 'i', 'j')),)),
         (29, 31, ((0, ('j', 'b')),)),
         (30, 31, ((1, ('j', 'b')),)),
         (31, 32, ((0, ('j', 'b')),)),
         (32, 33, ((0, ('b', 'h', 'i', 'j')),)),
         (33, 34, ((0, ('b', 'h', 'i', 'j')),)),
         (34, 35, ((0, ('b', 'h', 'i', 'j')),)),
         (35, 36, ((0, ('b', 'h', 'i', 'e')),)),
         (36, 37, ((0, ('b', 'i', 'h', 'e')),)),
         (38, 18, ((1, ('b',)),)),
         (39, 33, ((2, ()),)),
         (40, 38, ((1, ()),)),
         (41, 38, ((0, ('b',)),)),
         (42, 9, ((0, ('j',)),))]),
    "attention_decode": (
        [('param scale : f32', ()),
         ('input Q[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 128)),
         ('input K[d0, d1, d2, d3] : bf16', ('B', 'H', 'T', 128)),
         ('input V[d0, d1, d2, d3] : bf16', ('B', 'H', 'T', 128)),
         ('contraction sum(e)[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('elementwise mul[b, h, i, j] : f32 =s', ('B', 'H', 'S', 'T')),
         ('index j[j] : i32', ('T',)),
         ('broadcast broadcast[j, i] : i32', ('T', 'S')),
         ('index i[i] : i32', ('S',)),
         ('size T : i32', ()),
         ('size S : i32', ()),
         ('elementwise sub : i32', ()),
         ('elementwise add[i] : i32', ('S',)),
         ('broadcast broadcast[j, i] : i32', ('T', 'S')),
         ('elementwise le[j, i] : bool', ('T', 'S')),
         ('broadcast broadcast[j, i, b, h] : bool', ('T', 'S', 'B', 'H')),
         ('const -inf', ()),
         ('elementwise where[b, h, i, j] : f32 =m', ('B', 'H', 'S', 'T')),
         ('softmax(j)[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('contraction sum(j)[b, h, i, e] : f32', ('B', 'H', 'S', 128)),
         ('cast cast:bf16[b, h, i, e] : bf16 =O', ('B', 'H', 'S', 128)),
         ('output O[d0, d1, d2, d3] : bf16', ('B', 'H', 'S', 128))],
        [(0, 5, ((0, ()),)),
         (1, 4, ((0, ('b', 'h', 'i', 'e')),)),
         (2, 4, ((1, ('b', 'h', 'j', 'e')),)),
         (3, 19, ((1, ('b', 'h', 'j', 'e')),)),
         (4, 5, ((1, ('b', 'h', 'i', 'j')),)),
         (5, 17, ((1, ('b', 'h', 'i', 'j')),)),
         (6, 7, ((0, ('j',)),)),
         (7, 14, ((0, ('j', 'i')),)),
         (8, 12, ((0, ('i',)),)),
         (9, 11, ((0, ()),)),
         (10, 11, ((1, ()),)),
         (11, 12, ((1, ()),)),
         (12, 13, ((0, ('i',)),)),
         (13, 14, ((1, ('j', 'i')),)),
         (14, 15, ((0, ('j', 'i')),)),
         (15, 17, ((0, ('j', 'i', 'b', 'h')),)),
         (16, 17, ((2, ()),)),
         (17, 18, ((0, ('b', 'h', 'i', 'j')),)),
         (18, 19, ((0, ('b', 'h', 'i', 'j')),)),
         (19, 20, ((0, ('b', 'h', 'i', 'e')),)),
         (20, 21, ((0, ('b', 'h', 'i', 'e')),))]),
    "attention_gqa": (
        [('param scale : f32', ()),
         ('input Q[d0, d1, d2, d3] : f16', ('B', 'H', 'S', 128)),
         ('input K[d0, d1, d2, d3] : f16', ('B', 'KH', 'T', 128)),
         ('input V[d0, d1, d2, d3] : f16', ('B', 'KH', 'T', 128)),
         ('index h[h] : i32', ('H',)),
         ('const 4', ()),
         ('elementwise floordiv[h] : i32', ('H',)),
         ('gather [b, @1, j, e][b, h, j, e] : f16', ('B', 'H', 'T', 128)),
         ('contraction sum(e)[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('elementwise mul[b, h, i, j] : f32 =s', ('B', 'H', 'S', 'T')),
         ('softmax(j)[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('gather [b, @1, j, e][b, h, j, e] : f16', ('B', 'H', 'T', 128)),
         ('contraction sum(j)[b, h, i, e] : f32', ('B', 'H', 'S', 128)),
         ('cast cast:f16[b, h, i, e] : f16 =O', ('B', 'H', 'S', 128)),
         ('output O[d0, d1, d2, d3] : f16', ('B', 'H', 'S', 128)),
         ('elementwise floordiv[h] : i32', ('H',)),
         ('const 4', ()),
         ('index h[h] : i32', ('H',))],
        [(0, 9, ((0, ()),)),
         (1, 8, ((0, ('b', 'h', 'i', 'e')),)),
         (2, 7, ((0, ('b', '~1', 'j', 'e')),)),
         (3, 11, ((0, ('b', '~1', 'j', 'e')),)),
         (4, 15, ((0, ('h',)),)),
         (5, 15, ((1, ()),)),
         (6, 11, ((1, ('h',)),)),
         (7, 8, ((1, ('b', 'h', 'j', 'e')),)),
         (8, 9, ((1, ('b', 'h', 'i', 'j')),)),
         (9, 10, ((0, ('b', 'h', 'i', 'j')),)),
         (10, 12, ((0, ('b', 'h', 'i', 'j')),)),
         (11, 12, ((1, ('b', 'h', 'j', 'e')),)),
         (12, 13, ((0, ('b', 'h', 'i', 'e')),)),
         (13, 14, ((0, ('b', 'h', 'i', 'e')),)),
         (15, 7, ((1, ('h',)),)),
         (16, 6, ((1, ()),)),
         (17, 6, ((0, ('h',)),))]),
    "attention_sliding_window": (
        [('param scale : f32', ()),
         ('param W : i32', ()),
         ('input Q[d0, d1, d2, d3] : f16', ('B', 'H', 'S', 96)),
         ('input K[d0, d1, d2, d3] : f16', ('B', 'H', 'S', 96)),
         ('input V[d0, d1, d2, d3] : f16', ('B', 'H', 'S', 96)),
         ('contraction sum(e)[b, h, i, j] : f32', ('B', 'H', 'S', 'S')),
         ('elementwise mul[b, h, i, j] : f32 =s', ('B', 'H', 'S', 'S')),
         ('index j[j] : i32', ('S',)),
         ('broadcast broadcast[j, i] : i32', ('S', 'S')),
         ('index i[i] : i32', ('S',)),
         ('broadcast broadcast[j, i] : i32', ('S', 'S')),
         ('elementwise le[j, i] : bool', ('S', 'S')),
         ('elementwise sub[i] : i32', ('S',)),
         ('broadcast broadcast[j, i] : i32', ('S', 'S')),
         ('elementwise gt[j, i] : bool', ('S', 'S')),
         ('elementwise and[j, i] : bool', ('S', 'S')),
         ('broadcast broadcast[j, i, b, h] : bool', ('S', 'S', 'B', 'H')),
         ('const -inf', ()),
         ('elementwise where[b, h, i, j] : f32 =m', ('B', 'H', 'S', 'S')),
         ('softmax(j)[b, h, i, j] : f32', ('B', 'H', 'S', 'S')),
         ('contraction sum(j)[b, h, i, e] : f32', ('B', 'H', 'S', 96)),
         ('cast cast:f16[b, h, i, e] : f16 =O', ('B', 'H', 'S', 96)),
         ('output O[d0, d1, d2, d3] : f16', ('B', 'H', 'S', 96)),
         ('broadcast broadcast[j, i] : i32', ('S', 'S')),
         ('index i[i] : i32', ('S',)),
         ('index j[j] : i32', ('S',))],
        [(0, 6, ((0, ()),)),
         (1, 12, ((1, ()),)),
         (2, 5, ((0, ('b', 'h', 'i', 'e')),)),
         (3, 5, ((1, ('b', 'h', 'j', 'e')),)),
         (4, 20, ((1, ('b', 'h', 'j', 'e')),)),
         (5, 6, ((1, ('b', 'h', 'i', 'j')),)),
         (6, 18, ((1, ('b', 'h', 'i', 'j')),)),
         (7, 23, ((0, ('j',)),)),
         (8, 11, ((0, ('j', 'i')),)),
         (9, 10, ((0, ('i',)),)),
         (10, 11, ((1, ('j', 'i')),)),
         (11, 15, ((0, ('j', 'i')),)),
         (12, 13, ((0, ('i',)),)),
         (13, 14, ((1, ('j', 'i')),)),
         (14, 15, ((1, ('j', 'i')),)),
         (15, 16, ((0, ('j', 'i')),)),
         (16, 18, ((0, ('j', 'i', 'b', 'h')),)),
         (17, 18, ((2, ()),)),
         (18, 19, ((0, ('b', 'h', 'i', 'j')),)),
         (19, 20, ((0, ('b', 'h', 'i', 'j')),)),
         (20, 21, ((0, ('b', 'h', 'i', 'e')),)),
         (21, 22, ((0, ('b', 'h', 'i', 'e')),)),
         (23, 14, ((0, ('j', 'i')),)),
         (24, 12, ((0, ('i',)),)),
         (25, 8, ((0, ('j',)),))]),
    "attention_softcap": (
        [('param scale : f32', ()),
         ('param cap : f32', ()),
         ('input Q[d0, d1, d2, d3] : f16', ('B', 'H', 'S', 256)),
         ('input K[d0, d1, d2, d3] : f16', ('B', 'H', 'T', 256)),
         ('input V[d0, d1, d2, d3] : f16', ('B', 'H', 'T', 256)),
         ('contraction sum(e)[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('elementwise mul[b, h, i, j] : f32 =s', ('B', 'H', 'S', 'T')),
         ('elementwise div[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('elementwise tanh[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('elementwise mul[b, h, i, j] : f32 =c', ('B', 'H', 'S', 'T')),
         ('softmax(j)[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('contraction sum(j)[b, h, i, e] : f32', ('B', 'H', 'S', 256)),
         ('cast cast:f16[b, h, i, e] : f16 =O', ('B', 'H', 'S', 256)),
         ('output O[d0, d1, d2, d3] : f16', ('B', 'H', 'S', 256))],
        [(0, 6, ((0, ()),)),
         (1, 7, ((1, ()),)),
         (1, 9, ((0, ()),)),
         (2, 5, ((0, ('b', 'h', 'i', 'e')),)),
         (3, 5, ((1, ('b', 'h', 'j', 'e')),)),
         (4, 11, ((1, ('b', 'h', 'j', 'e')),)),
         (5, 6, ((1, ('b', 'h', 'i', 'j')),)),
         (6, 7, ((0, ('b', 'h', 'i', 'j')),)),
         (7, 8, ((0, ('b', 'h', 'i', 'j')),)),
         (8, 9, ((1, ('b', 'h', 'i', 'j')),)),
         (9, 10, ((0, ('b', 'h', 'i', 'j')),)),
         (10, 11, ((0, ('b', 'h', 'i', 'j')),)),
         (11, 12, ((0, ('b', 'h', 'i', 'e')),)),
         (12, 13, ((0, ('b', 'h', 'i', 'e')),))]),
    "attention_varlen_padded": (
        [('param scale : f32', ()),
         ('input Q[d0, d1, d2, d3] : f16', ('B', 'H', 'S', 128)),
         ('input K[d0, d1, d2, d3] : f16', ('B', 'H', 'T', 128)),
         ('input V[d0, d1, d2, d3] : f16', ('B', 'H', 'T', 128)),
         ('input Lq[d0] : i32', ('B',)),
         ('input Lk[d0] : i32', ('B',)),
         ('contraction sum(e)[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('elementwise mul[b, h, i, j] : f32 =s', ('B', 'H', 'S', 'T')),
         ('index i[i] : i32', ('S',)),
         ('broadcast broadcast[i, b] : i32', ('S', 'B')),
         ('broadcast broadcast[i, b] : i32', ('S', 'B')),
         ('elementwise lt[i, b] : bool', ('S', 'B')),
         ('broadcast broadcast[i, b, j] : bool', ('S', 'B', 'T')),
         ('index j[j] : i32', ('T',)),
         ('broadcast broadcast[j, b] : i32', ('T', 'B')),
         ('broadcast broadcast[j, b] : i32', ('T', 'B')),
         ('elementwise lt[j, b] : bool', ('T', 'B')),
         ('broadcast broadcast[i, b, j] : bool', ('S', 'B', 'T')),
         ('elementwise and[i, b, j] : bool', ('S', 'B', 'T')),
         ('broadcast broadcast[j, i, b] : i32', ('T', 'S', 'B')),
         ('elementwise sub[b] : i32', ('B',)),
         ('broadcast broadcast[i, b] : i32', ('S', 'B')),
         ('elementwise add[i, b] : i32', ('S', 'B')),
         ('broadcast broadcast[j, i, b] : i32', ('T', 'S', 'B')),
         ('elementwise le[j, i, b] : bool', ('T', 'S', 'B')),
         ('elementwise and[i, b, j] : bool', ('S', 'B', 'T')),
         ('broadcast broadcast[i, b, j, h] : bool', ('S', 'B', 'T', 'H')),
         ('const -inf', ()),
         ('elementwise where[b, h, i, j] : f32 =m', ('B', 'H', 'S', 'T')),
         ('softmax(j)[b, h, i, j] : f32', ('B', 'H', 'S', 'T')),
         ('contraction sum(j)[b, h, i, e] : f32', ('B', 'H', 'S', 128)),
         ('cast cast:f16[b, h, i, e] : f16 =O', ('B', 'H', 'S', 128)),
         ('output O[d0, d1, d2, d3] : f16', ('B', 'H', 'S', 128)),
         ('broadcast broadcast[i, b] : i32', ('S', 'B')),
         ('index j[j] : i32', ('T',)),
         ('index i[i] : i32', ('S',))],
        [(0, 7, ((0, ()),)),
         (1, 6, ((0, ('b', 'h', 'i', 'e')),)),
         (2, 6, ((1, ('b', 'h', 'j', 'e')),)),
         (3, 30, ((1, ('b', 'h', 'j', 'e')),)),
         (4, 10, ((0, ('b',)),)),
         (4, 20, ((1, ('b',)),)),
         (5, 15, ((0, ('b',)),)),
         (5, 20, ((0, ('b',)),)),
         (6, 7, ((1, ('b', 'h', 'i', 'j')),)),
         (7, 28, ((1, ('b', 'h', 'i', 'j')),)),
         (8, 33, ((0, ('i',)),)),
         (9, 11, ((0, ('i', 'b')),)),
         (10, 11, ((1, ('i', 'b')),)),
         (11, 12, ((0, ('i', 'b')),)),
         (12, 18, ((0, ('i', 'b', 'j')),)),
         (13, 14, ((0, ('j',)),)),
         (14, 16, ((0, ('j', 'b')),)),
         (15, 16, ((1, ('j', 'b')),)),
         (16, 17, ((0, ('j', 'b')),)),
         (17, 18, ((1, ('i', 'b', 'j')),)),
         (18, 25, ((0, ('i', 'b', 'j')),)),
         (19, 24, ((0, ('j', 'i', 'b')),)),
         (20, 21, ((0, ('b',)),)),
         (21, 22, ((1, ('i', 'b')),)),
         (22, 23, ((0, ('i', 'b')),)),
         (23, 24, ((1, ('j', 'i', 'b')),)),
         (24, 25, ((1, ('j', 'i', 'b')),)),
         (25, 26, ((0, ('i', 'b', 'j')),)),
         (26, 28, ((0, ('i', 'b', 'j', 'h')),)),
         (27, 28, ((2, ()),)),
         (28, 29, ((0, ('b', 'h', 'i', 'j')),)),
         (29, 30, ((0, ('b', 'h', 'i', 'j')),)),
         (30, 31, ((0, ('b', 'h', 'i', 'e')),)),
         (31, 32, ((0, ('b', 'h', 'i', 'e')),)),
         (33, 22, ((0, ('i', 'b')),)),
         (34, 19, ((0, ('j',)),)),
         (35, 9, ((0, ('i',)),))]),
    "masked_scores": (
        [('input Q[d0, d1, d2] : f16', ('B', 'S', 64)),
         ('input K[d0, d1, d2] : f16', ('B', 'T', 64)),
         ('input mask[d0, d1] : f32', ('B', 'T')),
         ('const 0.125', ()),
         ('contraction sum(e)[b, i, j] : f32', ('B', 'S', 'T')),
         ('elementwise mul[b, i, j] : f32', ('B', 'S', 'T')),
         ('broadcast broadcast[b, i, j] : f32', ('B', 'S', 'T')),
         ('elementwise add[b, i, j] : f32', ('B', 'S', 'T')),
         ('cast cast:f16[b, i, j] : f16 =P', ('B', 'S', 'T')),
         ('output P[d0, d1, d2] : f16', ('B', 'S', 'T'))],
        [(0, 4, ((0, ('b', 'i', 'e')),)),
         (1, 4, ((1, ('b', 'j', 'e')),)),
         (2, 6, ((0, ('b', 'j')),)),
         (3, 5, ((0, ()),)),
         (4, 5, ((1, ('b', 'i', 'j')),)),
         (5, 7, ((0, ('b', 'i', 'j')),)),
         (6, 7, ((1, ('b', 'i', 'j')),)),
         (7, 8, ((0, ('b', 'i', 'j')),)),
         (8, 9, ((0, ('b', 'i', 'j')),))]),
    # quantized GEMMs (issue 24): fp8 operands read directly (their f32() conversions absorbed), the
    # amax a reduction over m and n stored through a broadcast, block scales gathered at k / 128
    "fp8_gemm_amax": (
        [('param scale_a : f32', ()),
         ('param scale_b : f32', ()),
         ('input A[d0, d1] : f8e4m3', ('M', 'K')),
         ('input B[d0, d1] : f8e4m3', ('N', 'K')),
         ('contraction sum(k)[m, n] : f32', ('M', 'N')),
         ('elementwise mul : f32', ()),
         ('elementwise mul[m, n] : f32 =y', ('M', 'N')),
         ('cast cast:bf16[m, n] : bf16 =D', ('M', 'N')),
         ('output D[d0, d1] : bf16', ('M', 'N')),
         ('elementwise abs[m, n] : f32', ('M', 'N')),
         ('reduction max(m, n) : f32', ()),
         ('broadcast broadcast[z] : f32 =amax', (1,)),
         ('output amax[d0] : f32', (1,))],
        [(0, 5, ((0, ()),)),
         (1, 5, ((1, ()),)),
         (2, 4, ((0, ('m', 'k')),)),
         (3, 4, ((1, ('n', 'k')),)),
         (4, 6, ((1, ('m', 'n')),)),
         (5, 6, ((0, ()),)),
         (6, 7, ((0, ('m', 'n')),)),
         (6, 9, ((0, ('m', 'n')),)),
         (7, 8, ((0, ('m', 'n')),)),
         (9, 10, ((0, ('m', 'n')),)),
         (10, 11, ((0, ()),)),
         (11, 12, ((0, ('z',)),))]),
    "fp8_gemm_blockwise": (
        [('input A[d0, d1] : f8e4m3', ('M', 'K')),
         ('input B[d0, d1] : f8e4m3', ('N', 'K')),
         ('input sa[d0, d1] : f32', ('M', 'K/128')),
         ('input sb[d0, d1] : f32', ('N/128', 'K/128')),
         ('index k[k] : i32', ('K',)),
         ('const 128', ()),
         ('elementwise floordiv[k] : i32', ('K',)),
         ('gather [m, @1][m, k] : f32', ('M', 'K')),
         ('elementwise mul[m, k] : f32', ('M', 'K')),
         ('broadcast broadcast[m, k, n] : f32', ('M', 'K', 'N')),
         ('broadcast broadcast[m, k, n] : f8e4m3', ('M', 'K', 'N')),
         ('elementwise mul[m, k, n] : f32', ('M', 'K', 'N')),
         ('index n[n] : i32', ('N',)),
         ('elementwise floordiv[n] : i32', ('N',)),
         ('gather [@1, @2][n, k] : f32', ('N', 'K')),
         ('contraction sum(k)[m, n] : f32', ('M', 'N')),
         ('cast cast:bf16[m, n] : bf16 =D', ('M', 'N')),
         ('output D[d0, d1] : bf16', ('M', 'N')),
         ('elementwise floordiv[k] : i32', ('K',)),
         ('const 128', ()),
         ('const 128', ()),
         ('index k[k] : i32', ('K',))],
        [(0, 8, ((0, ('m', 'k')),)),
         (1, 10, ((0, ('n', 'k')),)),
         (2, 7, ((0, ('m', '~1')),)),
         (3, 14, ((0, ('~0', '~1')),)),
         (4, 18, ((0, ('k',)),)),
         (5, 13, ((1, ()),)),
         (6, 14, ((2, ('k',)),)),
         (7, 8, ((1, ('m', 'k')),)),
         (8, 9, ((0, ('m', 'k')),)),
         (9, 11, ((0, ('m', 'k', 'n')),)),
         (10, 11, ((1, ('m', 'k', 'n')),)),
         (11, 15, ((0, ('m', 'k', 'n')),)),
         (12, 13, ((0, ('n',)),)),
         (13, 14, ((1, ('n',)),)),
         (14, 15, ((1, ('n', 'k')),)),
         (15, 16, ((0, ('m', 'n')),)),
         (16, 17, ((0, ('m', 'n')),)),
         (18, 7, ((1, ('k',)),)),
         (19, 18, ((1, ()),)),
         (20, 6, ((1, ()),)),
         (21, 6, ((0, ('k',)),))]),
    "gemm_int8_dequant": (
        [('input A[d0, d1] : i8', ('M', 'K')),
         ('input B[d0, d1] : i8', ('N', 'K')),
         ('input sa[d0] : f32', ('M',)),
         ('input sb[d0] : f32', ('N',)),
         ('contraction sum(k)[m, n] : i32', ('M', 'N')),
         ('cast cast:f32[m, n] : f32', ('M', 'N')),
         ('broadcast broadcast[m, n] : f32', ('M', 'N')),
         ('elementwise mul[m, n] : f32', ('M', 'N')),
         ('broadcast broadcast[m, n] : f32', ('M', 'N')),
         ('elementwise mul[m, n] : f32', ('M', 'N')),
         ('cast cast:f16[m, n] : f16 =D', ('M', 'N')),
         ('output D[d0, d1] : f16', ('M', 'N'))],
        [(0, 4, ((0, ('m', 'k')),)),
         (1, 4, ((1, ('n', 'k')),)),
         (2, 6, ((0, ('m',)),)),
         (3, 8, ((0, ('n',)),)),
         (4, 5, ((0, ('m', 'n')),)),
         (5, 7, ((0, ('m', 'n')),)),
         (6, 7, ((1, ('m', 'n')),)),
         (7, 9, ((0, ('m', 'n')),)),
         (8, 9, ((1, ('m', 'n')),)),
         (9, 10, ((0, ('m', 'n')),)),
         (10, 11, ((0, ('m', 'n')),))]),
    # the MoE grouped GEMM (issue 24): X and Y packed by expert
    "moe_grouped_gemm": (
        [('input X[d0, d1, d2] : bf16', ('E', 'T', 'D')),
         ('input off[d0] : i32', ('E+1',)),
         ('input W[d0, d1, d2] : bf16', ('E', 'F', 'D')),
         ('input bias[d0, d1] : bf16', ('E', 'F')),
         ('input rw[d0, d1] : f32', ('E', 'T')),
         ('broadcast broadcast[e, t, f] : f32', ('E', 'T', 'F')),
         ('contraction sum(d)[e, t, f] : f32', ('E', 'T', 'F')),
         ('cast cast:f32[e, f] : f32', ('E', 'F')),
         ('broadcast broadcast[e, t, f] : f32', ('E', 'T', 'F')),
         ('elementwise add[e, t, f] : f32', ('E', 'T', 'F')),
         ('elementwise silu[e, t, f] : f32', ('E', 'T', 'F')),
         ('elementwise mul[e, t, f] : f32', ('E', 'T', 'F')),
         ('cast cast:bf16[e, t, f] : bf16 =Y', ('E', 'T', 'F')),
         ('output Y[d0, d1, d2] : bf16', ('E', 'T', 'F'))],
        [(0, 6, ((0, ('e', 't', 'd')),)),
         (2, 6, ((1, ('e', 'f', 'd')),)),
         (3, 7, ((0, ('e', 'f')),)),
         (4, 5, ((0, ('e', 't')),)),
         (5, 11, ((0, ('e', 't', 'f')),)),
         (6, 9, ((0, ('e', 't', 'f')),)),
         (7, 8, ((0, ('e', 'f')),)),
         (8, 9, ((1, ('e', 't', 'f')),)),
         (9, 10, ((0, ('e', 't', 'f')),)),
         (10, 11, ((1, ('e', 't', 'f')),)),
         (11, 12, ((0, ('e', 't', 'f')),)),
         (12, 13, ((0, ('e', 't', 'f')),))]),
    # the MoE GEMM over gathered token rows (issue 24)
    "moe_gather_gemm": (
        [('input X[d0, d1] : bf16', ('N', 'D')),
         ('input idx[d0, d1] : i32', ('E', 'T')),
         ('input off[d0] : i32', ('E+1',)),
         ('input W[d0, d1, d2] : bf16', ('E', 'F', 'D')),
         ('input rw[d0, d1] : f32', ('E', 'T')),
         ('broadcast broadcast[e, t, f] : f32', ('E', 'T', 'F')),
         ('gather [@1, d][e, t, d] : bf16', ('E', 'T', 'D')),
         ('contraction sum(d)[e, t, f] : f32', ('E', 'T', 'F')),
         ('elementwise mul[e, t, f] : f32', ('E', 'T', 'F')),
         ('cast cast:bf16[e, t, f] : bf16 =Y', ('E', 'T', 'F')),
         ('output Y[d0, d1, d2] : bf16', ('E', 'T', 'F'))],
        [(0, 6, ((0, ('~0', 'd')),)),
         (1, 6, ((1, ('e', 't')),)),
         (3, 7, ((1, ('e', 'f', 'd')),)),
         (4, 5, ((0, ('e', 't')),)),
         (5, 8, ((0, ('e', 't', 'f')),)),
         (6, 7, ((0, ('e', 't', 'd')),)),
         (7, 8, ((1, ('e', 't', 'f')),)),
         (8, 9, ((0, ('e', 't', 'f')),)),
         (9, 10, ((0, ('e', 't', 'f')),))]),
    # MXFP8 (issue 24): E8M0 scales per 32 values of K, gathered at k / 32
    "mxfp8_gemm": (
        [('input A[d0, d1] : f8e4m3', ('M', 'K')),
         ('input B[d0, d1] : f8e4m3', ('N', 'K')),
         ('input sa[d0, d1] : f8e8m0', ('M', 'K/32')),
         ('input sb[d0, d1] : f8e8m0', ('N', 'K/32')),
         ('index k[k] : i32', ('K',)),
         ('const 32', ()),
         ('elementwise floordiv[k] : i32', ('K',)),
         ('gather [m, @1][m, k] : f8e8m0', ('M', 'K')),
         ('elementwise mul[m, k] : f32', ('M', 'K')),
         ('broadcast broadcast[m, k, n] : f32', ('M', 'K', 'N')),
         ('broadcast broadcast[m, k, n] : f8e4m3', ('M', 'K', 'N')),
         ('elementwise mul[m, k, n] : f32', ('M', 'K', 'N')),
         ('gather [n, @1][n, k] : f8e8m0', ('N', 'K')),
         ('contraction sum(k)[m, n] : f32', ('M', 'N')),
         ('cast cast:bf16[m, n] : bf16 =D', ('M', 'N')),
         ('output D[d0, d1] : bf16', ('M', 'N')),
         ('elementwise floordiv[k] : i32', ('K',)),
         ('const 32', ()),
         ('index k[k] : i32', ('K',))],
        [(0, 8, ((0, ('m', 'k')),)),
         (1, 10, ((0, ('n', 'k')),)),
         (2, 7, ((0, ('m', '~1')),)),
         (3, 12, ((0, ('n', '~1')),)),
         (4, 16, ((0, ('k',)),)),
         (5, 16, ((1, ()),)),
         (6, 12, ((1, ('k',)),)),
         (7, 8, ((1, ('m', 'k')),)),
         (8, 9, ((0, ('m', 'k')),)),
         (9, 11, ((0, ('m', 'k', 'n')),)),
         (10, 11, ((1, ('m', 'k', 'n')),)),
         (11, 13, ((0, ('m', 'k', 'n')),)),
         (12, 13, ((1, ('n', 'k')),)),
         (13, 14, ((0, ('m', 'n')),)),
         (14, 15, ((0, ('m', 'n')),)),
         (16, 7, ((1, ('k',)),)),
         (17, 6, ((1, ()),)),
         (18, 6, ((0, ('k',)),))]),
    # NVFP4 (issue 24): E4M3 scales per 16 values of K, gathered at k / 16, and a global alpha
    "nvfp4_gemm": (
        [('param alpha : f32', ()),
         ('input A[d0, d1] : f4e2m1', ('M', 'K')),
         ('input B[d0, d1] : f4e2m1', ('N', 'K')),
         ('input sa[d0, d1] : f8e4m3', ('M', 'K/16')),
         ('input sb[d0, d1] : f8e4m3', ('N', 'K/16')),
         ('index k[k] : i32', ('K',)),
         ('const 16', ()),
         ('elementwise floordiv[k] : i32', ('K',)),
         ('gather [m, @1][m, k] : f8e4m3', ('M', 'K')),
         ('elementwise mul[m, k] : f32', ('M', 'K')),
         ('broadcast broadcast[m, k, n] : f32', ('M', 'K', 'N')),
         ('broadcast broadcast[m, k, n] : f4e2m1', ('M', 'K', 'N')),
         ('elementwise mul[m, k, n] : f32', ('M', 'K', 'N')),
         ('gather [n, @1][n, k] : f8e4m3', ('N', 'K')),
         ('contraction sum(k)[m, n] : f32', ('M', 'N')),
         ('elementwise mul[m, n] : f32', ('M', 'N')),
         ('cast cast:bf16[m, n] : bf16 =D', ('M', 'N')),
         ('output D[d0, d1] : bf16', ('M', 'N')),
         ('elementwise floordiv[k] : i32', ('K',)),
         ('const 16', ()),
         ('index k[k] : i32', ('K',))],
        [(0, 15, ((0, ()),)),
         (1, 9, ((0, ('m', 'k')),)),
         (2, 11, ((0, ('n', 'k')),)),
         (3, 8, ((0, ('m', '~1')),)),
         (4, 13, ((0, ('n', '~1')),)),
         (5, 18, ((0, ('k',)),)),
         (6, 18, ((1, ()),)),
         (7, 13, ((1, ('k',)),)),
         (8, 9, ((1, ('m', 'k')),)),
         (9, 10, ((0, ('m', 'k')),)),
         (10, 12, ((0, ('m', 'k', 'n')),)),
         (11, 12, ((1, ('m', 'k', 'n')),)),
         (12, 14, ((0, ('m', 'k', 'n')),)),
         (13, 14, ((1, ('n', 'k')),)),
         (14, 15, ((1, ('m', 'n')),)),
         (15, 16, ((0, ('m', 'n')),)),
         (16, 17, ((0, ('m', 'n')),)),
         (18, 8, ((1, ('k',)),)),
         (19, 7, ((1, ()),)),
         (20, 7, ((0, ('k',)),))]),
}


def test_every_shipped_spec_is_covered():
    assert {p.stem for p in SPECS.glob("*.kspec")} == set(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_graph_structure(name):
    k = load_spec(SPECS / f"{name}.kspec").kernels[0]
    g = build_graph(k)
    canonicalize(g)
    validate(g)
    want_nodes, want_edges = SHIPPED[name]
    nodes = ordered(g)
    assert [(op(g, n).label(), op(g, n).shape) for n in nodes] == want_nodes
    idx = {n: i for i, n in enumerate(nodes)}
    assert sorted((idx[u], idx[v], g.edges[u, v]["uses"]) for u, v in g.edges) == want_edges
    # inputs keep their declared layout; every spec tensor names exactly one node
    for t in k.inputs:
        (n,) = [n for n in g if op(g, n).kind == "input" and op(g, n).name == t.name]
        assert op(g, n).layout == t.layout and op(g, n).dtype == t.dtype and op(g, n).shape == t.shape
    for t in k.outputs:
        (n,) = [n for n in g if op(g, n).kind == "output" and op(g, n).name == t.name]
        (src, lab), = operands(g, n)
        assert op(g, src).name == t.name and lab == op(g, src).axes


def test_named_values_and_reduction_fields():
    g = graph_of((SPECS / "gemm_rowmax.kspec").read_text())
    red = only(g, "reduction")
    assert (op(g, red).name, op(g, red).fn, op(g, red).reduced, op(g, red).reduced_shape) == ("rowmax", "max", ("n",), ("N",))
    c = only(g, "contraction")
    assert (op(g, c).name, op(g, c).reduced, op(g, c).reduced_shape) == ("acc", ("k",), ("K",))
    g = graph_of((SPECS / "attention_causal.kspec").read_text())
    sm = only(g, "softmax")
    assert (op(g, sm).name, op(g, sm).fn, op(g, sm).causal) == ("p", "j", "i")


def test_raw_graph_has_the_copy_that_canonicalisation_removes():
    g = build_graph(load_spec(SPECS / "gemm.kspec").kernels[0])
    assert "elementwise copy[m, n] : f32" in labels(g)
    stats = canonicalize(g)
    assert stats["copies"] == 1
    assert not [n for n in g if op(g, n).fn == "copy"]
    # the cast now reads the contraction directly
    cast = only(g, "cast")
    ((src, lab),) = operands(g, cast)
    assert op(g, src).kind == "contraction" and lab == ("m", "n")


# ---------------------------------------------------------------- validate()

def _gemm_graph():
    return graph_of((SPECS / "gemm_bias_relu.kspec").read_text())


def _break_cycle(g):
    g.add_edge(only(g, "cast"), only(g, "contraction"), uses=((2, ("m", "n")),))


def _break_kind(g):
    n = only(g, "elementwise", "relu")
    g.nodes[n]["op"] = OpNode("mystery", "f32", ("m", "n"), ("M", "N"))


def _break_rank(g):
    n = only(g, "elementwise", "relu")
    o = op(g, n)
    g.nodes[n]["op"] = OpNode(o.kind, o.dtype, o.axes, ("M",), fn=o.fn)


def _break_two_producers(g):
    n = only(g, "elementwise", "relu")
    o = op(g, n)
    g.nodes[n]["op"] = OpNode(o.kind, o.dtype, o.axes, o.shape, fn=o.fn, name="D")


def _break_labels(g):
    u, v = only(g, "contraction"), only(g, "elementwise", "add")
    g.edges[u, v]["uses"] = ((0, ("m",)),)


def _break_output_consumer(g):
    g.add_node("n99", op=OpNode("elementwise", "f16", ("d0", "d1"), ("M", "N"), fn="relu"))
    g.add_edge(only(g, "output"), "n99", uses=((0, ("d0", "d1")),))


def _break_input_producer(g):
    bias = [n for n in g if op(g, n).name == "bias"][0]
    g.add_node("n99", op=OpNode("const", "f32", (), (), value=1.0))
    g.add_edge("n99", bias, uses=((0, ()),))


def _break_transposed_output(g):
    out = only(g, "output")
    (src, _), = operands(g, out)
    g.edges[src, out]["uses"] = ((0, ("n", "m")),)


@pytest.mark.parametrize("breaker, message", [
    (_break_cycle, "cycle"),
    (_break_kind, "unknown kind mystery"),
    (_break_rank, "2 axes but 1 extents"),
    (_break_two_producers, "tensor D has two producers"),
    (_break_labels, "1 labels for a rank-2 value"),
    (_break_output_consumer, "exactly one producer and no consumers"),
    (_break_input_producer, "input node"),
    (_break_transposed_output, "in its axis order"),
])
def test_validate_rejects_broken_graphs(breaker, message):
    g = _gemm_graph()
    validate(g)
    breaker(g)
    with pytest.raises(KspecInternalError, match=message):
        validate(g)


# ---------------------------------------------------------------- canonicalisation

def test_constants_are_folded():
    g = graph_of("""kernel c { in x : f32[M, N]
      out y : f32[M, N]
      y[m, n] = 2.0 * 3.0 * x[m, n] }""")
    assert labels(g) == ["input x[d0, d1] : f32", "const 6.0", "elementwise mul[m, n] : f32 =y",
                         "output y[d0, d1] : f32"]
    g = graph_of("""kernel c { in x : f32[M]
      out y : f32[M]
      y[m] = x[m] * ((1.0 + 2.0) * -(4.0 - 1.5)) + maximum(2.0, 5.0) / 2.0 }""")
    consts = sorted(op(g, n).value for n in g if op(g, n).kind == "const")
    assert consts == [-7.5, 2.5]
    assert sorted(op(g, n).fn for n in g if op(g, n).kind == "elementwise") == ["add", "mul"]


def test_fold_constants_counts_and_keeps_params():
    g = graph_of("""kernel c { param a : f32 = 2.0
      in x : f32[M]
      out y : f32[M]
      y[m] = a * 3.0 * x[m] }""", canon=False)
    remove_copies(g)
    assert fold_constants(g) == 0          # a param is a runtime value: a*3 is not folded
    assert any(op(g, n).kind == "param" for n in g)
    assert [op(g, n).label() for n in ordered(g) if op(g, n).kind == "elementwise"] == \
        ["elementwise mul : f32", "elementwise mul[m] : f32 =y"]


def test_common_subexpressions_are_merged():
    g = graph_of("""kernel c { in a : f32[M, N]
      out y : f32[M, N]
      y[m, n] = gelu(a[m, n]) + gelu(a[m, n]) }""")
    gelu = only(g, "elementwise", "gelu")
    add = only(g, "elementwise", "add")
    assert g.edges[gelu, add]["uses"] == ((0, ("m", "n")), (1, ("m", "n")))
    assert labels(g) == ["input a[d0, d1] : f32", "elementwise gelu[m, n] : f32",
                         "elementwise add[m, n] : f32 =y", "output y[d0, d1] : f32"]


def test_cse_keeps_different_operand_orders_apart():
    g = graph_of("""kernel c { in a : f32[M, N]
      in b : f32[M, N]
      out y : f32[M, N]
      y[m, n] = (a[m, n] - b[m, n]) * (b[m, n] - a[m, n]) }""", canon=False)
    assert merge_common_subexpressions(g) == 0
    assert len([n for n in g if op(g, n).fn == "sub"]) == 2


def test_dead_statements_are_removed():
    g = graph_of("""kernel c { in a : f32[M, N]
      in unused : f32[M]
      out y : f32[M, N]
      t[m, n] = exp(a[m, n])
      r[m] = sum(n) a[m, n]
      y[m, n] = relu(a[m, n]) }""", canon=False)
    assert remove_copies(g) == 0
    assert remove_dead(g) == 2             # exp and the sum; inputs stay (they are the signature)
    assert labels(g) == ["input a[d0, d1] : f32", "input unused[d0] : f32", "elementwise relu[m, n] : f32 =y",
                         "output y[d0, d1] : f32"]


def test_copy_of_an_input_into_an_output_is_kept():
    g = graph_of("""kernel c { in a : f32[M, N]
      out y : f32[N, M]
      out z : f32[M, N]
      y[n, m] = a[m, n]
      z[m, n] = a[m, n] }""")
    copies = sorted(op(g, n).label() for n in g if op(g, n).fn == "copy")
    assert copies == ["elementwise copy[m, n] : f32 =z", "elementwise copy[n, m] : f32 =y"]


def test_transposing_copy_into_an_output_is_kept():
    g = graph_of("""kernel c { in a : f32[M, N]
      out d : f32[M, N]
      out e : f32[N, M]
      d[m, n] = exp(a[m, n])
      e[n, m] = d[m, n] }""")
    copy = only(g, "elementwise", "copy")
    assert op(g, copy).axes == ("n", "m") and op(g, copy).name == "e"
    ((src, lab),) = operands(g, copy)
    assert op(g, src).fn == "exp" and lab == ("m", "n")


# ---------------------------------------------------------------- GEMM recognition

def _gemm(src: str) -> GemmInfo | str:
    g = graph_of(src)
    return g, gemm_info(g, only(g, "contraction"))


@pytest.mark.parametrize("la, lb, a_layout, b_layout", [
    ("", "", "row", "row"), ("", " col", "row", "col"), (" col", "", "col", "row"), (" col", " col", "col", "col")])
def test_gemm_operand_layouts(la, lb, a_layout, b_layout):
    g, gi = _gemm(f"""kernel c {{ in A : f16[M, K]{la}
      in B : f16[K, N]{lb}
      out D : f32[M, N]
      D[m, n] = sum(k) A[m, k] * B[k, n] }}""")
    assert isinstance(gi, GemmInfo)
    assert (op(g, gi.a).name, op(g, gi.b).name, gi.m, gi.n, gi.k, gi.batch) == ("A", "B", "m", "n", "k", ())
    assert (gi.a_layout, gi.b_layout) == (a_layout, b_layout)


@pytest.mark.parametrize("la, lb, a_layout, b_layout", [
    ("", "", "col", "col"), (" col", " col", "row", "row"), (" col", "", "row", "col")])
def test_gemm_transposed_accesses_flip_layouts(la, lb, a_layout, b_layout):
    g, gi = _gemm(f"""kernel c {{ in A : f16[K, M]{la}
      in B : f16[N, K]{lb}
      out D : f32[M, N]
      D[m, n] = sum(k) A[k, m] * B[n, k] }}""")
    assert (op(g, gi.a).name, op(g, gi.b).name, gi.m, gi.n, gi.k) == ("A", "B", "m", "n", "k")
    assert (gi.a_layout, gi.b_layout) == (a_layout, b_layout)


def test_gemm_operands_in_either_order():
    g, gi = _gemm("""kernel c { in A : f16[M, K]
      in B : f16[K, N] col
      out D : f32[M, N]
      D[m, n] = sum(k) B[k, n] * A[m, k] }""")
    assert (op(g, gi.a).name, op(g, gi.b).name, gi.a_layout, gi.b_layout) == ("A", "B", "row", "col")


def test_gemm_with_transposed_result_swaps_roles():
    # D[n, m] = (A B)^T = B^T A^T: the GEMM's rows are n and its A operand is B
    g, gi = _gemm("""kernel c { in A : f16[M, K]
      in B : f16[K, N]
      out D : f32[N, M]
      D[n, m] = sum(k) A[m, k] * B[k, n] }""")
    assert (op(g, gi.a).name, op(g, gi.b).name, gi.m, gi.n) == ("B", "A", "n", "m")
    assert (gi.a_layout, gi.b_layout) == ("col", "col")


def test_batched_gemm():
    g, gi = _gemm((SPECS / "batched_gemm.kspec").read_text())
    assert (gi.batch, gi.m, gi.n, gi.k, gi.a_layout, gi.b_layout) == (("b",), "m", "n", "k", "row", "row")
    g, gi = _gemm("""kernel c { in A : f16[L, M, K]
      in B : f16[L, N, K]
      out D : f32[L, M, N]
      D[b, m, n] = sum(k) A[b, m, k] * B[b, n, k] }""")
    assert (gi.batch, gi.b_layout) == (("b",), "col")
    g, gi = _gemm("""kernel c { in A : f16[L, M, K] col
      in B : f16[L, K, N]
      out D : f32[L, M, N]
      D[b, m, n] = sum(k) A[b, m, k] * B[b, k, n] }""")
    assert (gi.batch, gi.a_layout) == (("b",), "col")


@pytest.mark.parametrize("b_decl, b_read, b_layout", [("f16[H, E, N]", "W[h, e, n]", "row"),
                                                      ("f16[N, H, E]", "W[n, h, e]", "col")])
def test_reduced_axes_innermost_in_both_operands_fold_into_k(b_decl, b_read, b_layout):
    _, gi = _gemm(f"""kernel c {{ in O : f16[B, S, H, E]
      in W : {b_decl}
      out Y : f32[B, S, N]
      Y[b, s, n] = sum(h, e) O[b, s, h, e] * {b_read} }}""")
    assert isinstance(gi, GemmInfo)
    assert (gi.m_fold, gi.m, gi.k_fold, gi.k, gi.n, gi.batch) == (("b",), "s", ("h",), "e", "n", ())
    assert (gi.a_layout, gi.b_layout) == ("row", b_layout)
    assert (gi.m_labels, gi.k_labels) == (("b", "s"), ("h", "e"))


@pytest.mark.parametrize("src, reason", [
    ("""kernel c { in A : f16[M, K, J]
      in B : f16[J, K, N]
      out D : f32[M, N]
      D[m, n] = sum(k, j) A[m, k, j] * B[j, k, n] }""",
     "it reduces over 2 indices that are not the innermost axes of both operands in one order"),
    ("""kernel c { in A : f16[M, K]
      in x : f16[K]
      out y : f32[M]
      y[m] = sum(k) A[m, k] * x[k] }""", "its result has fewer than two axes"),
    ("""kernel c { in A : f16[M, L, K]
      in B : f16[L, K, N]
      out D : f32[L, M, N]
      D[b, m, n] = sum(k) A[m, b, k] * B[b, k, n] }""",
     "batch axes are not the outermost axes of every operand in the same order"),
    ("""kernel c { in A : f16[M, N, K]
      in B : f16[K, N]
      out D : f32[M, N]
      D[m, n] = sum(k) A[m, n, k] * B[k, n] }""", "its operands are not [batch.., m, k] and [batch.., k, n]"),
])
def test_non_gemm_contractions_give_a_reason(src, reason):
    _, gi = _gemm(src)
    assert gi == reason
