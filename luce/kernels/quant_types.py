"""GGUF block layouts shared by the numpy references and the CUDA kernels."""
from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

SUPPORTED_TYPES: frozenset[T] = frozenset({
    T.F32, T.F16, T.BF16,
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
})


def as_qtype(qtype) -> T:
    """Accept a GGMLQuantizationType, its int value or its name ("Q4_K")."""
    if isinstance(qtype, str):
        return T[qtype.upper()]
    return T(int(qtype))


def block_elems(qtype) -> int:
    return GGML_QUANT_SIZES[as_qtype(qtype)][0]


def block_bytes(qtype) -> int:
    return GGML_QUANT_SIZES[as_qtype(qtype)][1]


def row_bytes(qtype, n_cols: int) -> int:
    """Bytes of one row of n_cols elements."""
    qtype = as_qtype(qtype)
    qk, ts = GGML_QUANT_SIZES[qtype]
    if n_cols % qk:
        raise ValueError(f"{qtype.name}: row of {n_cols} elements is not a multiple of the block size {qk}")
    return n_cols // qk * ts
