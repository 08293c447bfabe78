"""numpy storage types, rounding and elementwise functions of kspec dtypes (f16/bf16/fp8/fp4 through
ml_dtypes): the numerics the reference executor computes with, shared with the compiler (its float64
check of a score modification's derivative, compiler/attention_grad.py) and the CuTe backend."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

STORAGE = {
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f32": np.dtype(np.float32),
    "tf32": np.dtype(np.float32),            # stored as f32; rounded to tf32 where the MMA reads it
    "f8e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "f8e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "i8": np.dtype(np.int8),
    "i32": np.dtype(np.int32),
    "bool": np.dtype(np.bool_),              # a condition: only ever a value inside a kernel
    # host arrays hold one FP4 value a byte (ml_dtypes); device memory packs two (kspec.core)
    "f4e2m1": np.dtype(ml_dtypes.float4_e2m1fn),
    "f8e8m0": np.dtype(ml_dtypes.float8_e8m0fnu),
}

# ---- block-scaled formats -------------------------------------------------------------------
# FP4 e2m1 (MXFP4, NVFP4 data): sign, 2 exponent bits, 1 mantissa bit; no infinity, no NaN.
# Its magnitudes, in encoding order (the mantissa bit is the encoding's lowest bit):
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def round_e2m1(x) -> np.ndarray:
    """f32 values rounded to FP4 e2m1 (as f32): to the nearest magnitude, a tie to the one whose
    encoding is even (mantissa bit 0: 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4), the sign kept (-0
    exists); magnitudes above 6, infinities included, saturate to 6 (PTX's cvt.rn.satfinite); NaN,
    which e2m1 cannot hold, becomes +6 (the largest value, as satfinite does for what it cannot
    represent)."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x.astype(np.float64))
    hi = np.clip(np.searchsorted(E2M1_MAGNITUDES, a, side="left"), 1, 7)
    lo = hi - 1
    dl, dh = a - E2M1_MAGNITUDES[lo], E2M1_MAGNITUDES[hi] - a
    pick = np.where(dl < dh, lo, np.where(dh < dl, hi, np.where(lo % 2 == 0, lo, hi)))
    mag = np.where(a >= 6.0, 6.0, E2M1_MAGNITUDES[pick])
    out = np.copysign(mag, x.astype(np.float64))
    return np.where(np.isnan(x), 6.0, out).astype(np.float32)


def round_e8m0(x) -> np.ndarray:
    """f32 values rounded to the E8M0 scale format (as f32): a power of two 2^e, e in [-127, 127],
    no sign, no zero.  A positive finite x = m * 2^e (1 <= m < 2) rounds to 2^e when m < 1.5 and to
    2^(e+1) otherwise (nearest, ties up); below 2^-127 it saturates to 2^-127; 2^128 and above, zero,
    negative values, infinities and NaN are NaN (encoding 0xFF).  (ml_dtypes' float8_e8m0fnu
    conversion; PTX's cvt.ue8m0x2 rounds toward zero or up instead: compute a scale with floor/ceil of
    log2 first when that matters.)"""
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        m, e = np.frexp(np.where(np.isfinite(x) & (x > 0), x, 1.0))      # x = m * 2^e, 0.5 <= m < 1
        e = e - 1 + (m >= 0.75)                                           # (2m = mantissa in [1, 2))
        e = np.maximum(e, -127)
        out = np.ldexp(1.0, e)
    bad = ~np.isfinite(x) | (x <= 0) | (e > 127)
    return np.where(bad, np.nan, out).astype(np.float32)
INT_LIMITS = {"i8": (-128, 127), "i32": (-(1 << 31), (1 << 31) - 1)}


def storage_dtype(dtype: str) -> np.dtype:
    return STORAGE[dtype]


def is_int(dtype: str) -> bool:
    return dtype in INT_LIMITS


def round_tf32(x: np.ndarray) -> np.ndarray:
    """Round f32 values to tf32 (10 explicit mantissa bits), nearest-even, as the tensor cores read them."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (bits >> 13) & 1
    rounded = (bits + 0x0FFF + lsb) & np.uint32(0xFFFFE000)
    finite = np.isfinite(x)
    return np.where(finite, rounded.view(np.float32), x).astype(np.float32)


def to_storage(x, dtype: str) -> np.ndarray:
    """Round/convert a computed value to the storage of `dtype` (ints: round to nearest, saturate)."""
    x = np.asarray(x)
    if is_int(dtype):
        lo, hi = INT_LIMITS[dtype]
        if x.dtype.kind == "f":
            x = np.rint(x)
        return np.clip(x, lo, hi).astype(STORAGE[dtype])
    if dtype in ("f8e4m3",):
        # e4m3fn has no infinity: saturate to the largest finite value like the hardware's satfinite
        x = np.clip(np.asarray(x, dtype=np.float32), -448.0, 448.0)
    elif dtype == "f4e2m1":
        return round_e2m1(x).astype(STORAGE[dtype])
    elif dtype == "f8e8m0":
        return round_e8m0(x).astype(STORAGE[dtype])
    with np.errstate(over="ignore"):      # out-of-range values become inf, as on the GPU
        return np.asarray(x).astype(STORAGE[dtype])


def to_compute(x) -> np.ndarray:
    """Values as the hardware computes with them: f32 for floats, int64 for integers."""
    x = np.asarray(x)
    if x.dtype.kind in "iu":
        return x.astype(np.int64)
    if x.dtype.kind == "b":
        return x
    return x.astype(np.float32)


_SQRT_HALF = 1.0 / math.sqrt(2.0)


def erf(x: np.ndarray) -> np.ndarray:
    """erf to 1.5e-7 absolute (Abramowitz & Stegun 7.1.26), enough for f32 results."""
    x = np.asarray(x, dtype=np.float64)
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t \
        * np.exp(-a * a)
    return s * y


def gelu(x):
    x64 = np.asarray(x, dtype=np.float64)
    return (0.5 * x64 * (1.0 + erf(x64 * _SQRT_HALF))).astype(np.float32)


def gelu_tanh(x):
    x = np.asarray(x, dtype=np.float32)
    return 0.5 * x * (1.0 + np.tanh(np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * x ** 3)))


def sigmoid(x):
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


FUNCTIONS = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "neg": np.negative,
    "maximum": np.maximum, "minimum": np.minimum, "abs": np.abs,
    "relu": lambda x: np.maximum(x, 0), "gelu": gelu, "gelu_tanh": gelu_tanh, "sigmoid": sigmoid,
    "silu": lambda x: np.asarray(x, dtype=np.float32) * sigmoid(x), "tanh": np.tanh, "exp": np.exp,
    "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "clamp": lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi),
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
    "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or, "not": np.logical_not,
    "where": lambda c, a, b: np.where(np.asarray(c, dtype=bool), a, b),
}


def floordiv(a, b):
    """Integer `/`: floor division (rounds toward -inf, as Python's //)."""
    return np.floor_divide(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))


def mod(a, b):
    """Integer `%`: the modulo matching floor division, a - b * (a / b): non-negative for b > 0."""
    return np.mod(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))


def divide(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        # C semantics: truncate toward zero; division by zero gives 0 rather than a trap
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(b != 0, np.trunc(a / np.where(b == 0, 1, b)), 0)
        return q.astype(np.int64)
    return np.divide(a, b)
