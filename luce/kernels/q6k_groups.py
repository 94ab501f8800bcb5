"""Q6_K rows regrouped for 16-byte loads: the "g8" layout of matvec_fast's Q6_K units.

Why: a Q6_K block is 210 bytes, so blocks sit at every even offset mod 16 and each
16-byte piece a lane reads costs two aligned loads and eight selects (matvec_fast.ld16),
and its scales and d five 2-byte loads: in the decode down product's loop (sm_90 SASS)
~70 of ~500 instructions a unit are the selects, 36 load instructions where aligned data
would take 10. Eight blocks are 1,680 bytes, a multiple of 16: regrouped as the eight
blocks' ql (8 x 128 bytes), then their qh (8 x 64), scales (8 x 16) and d (8 x 2), every
piece a lane reads is one aligned load. The bytes and the row size are those of Q6_K;
rows need a multiple of 8 blocks (2,048 columns: Qwen3-8B's 4,096 and 12,288, not
Qwen3-32B's 5,120).

Status: read by matvec_fast(..., layout="g8") over int8 x and matvec_mma(..., layout="g8"),
both the GGUF layout's bits (simulator and H200). On the H200 (thirty-first session) the
23-node verification forward over it took 5.21-5.25 ms against 5.42-5.48, and the decode
down product with its norm profiled slower (19.0 against 16.2 us), so the CUDA backend
keeps a copy beside the GGUF one (LUCE_Q6K_G8, on where it fits) for the verification
products only.
"""
from __future__ import annotations

import numpy as np

__all__ = ["G8_COLS", "GROUP_BYTES", "PARTS", "g8_ref", "g8_applies"]

BLOCK = 210
GROUP = 8                    # blocks a group
GROUP_BYTES = GROUP * BLOCK  # 1,680 = 105 x 16
G8_COLS = 256 * GROUP        # columns a group covers
# (offset, bytes) of each part of a block, and where its group's copies of it start
PARTS = ((0, 128), (128, 64), (192, 16), (208, 2))
PART_START = (0, 1024, 1536, 1664)


def g8_applies(n_cols: int) -> bool:
    return n_cols % G8_COLS == 0


def g8_ref(raw: np.ndarray, n_rows: int, n_cols: int) -> np.ndarray:
    """Q6_K bytes (n_rows rows of n_cols columns, any shape of uint8) regrouped: (n_rows,
    row bytes) uint8."""
    if not g8_applies(n_cols):
        raise ValueError(f"q6k_groups: {n_cols} columns is not a multiple of {G8_COLS}")
    nb = n_cols // 256
    b = np.ascontiguousarray(raw, np.uint8).reshape(n_rows, nb // GROUP, GROUP, BLOCK)
    parts = [b[..., o:o + n].reshape(n_rows, nb // GROUP, GROUP * n) for o, n in PARTS]
    return np.concatenate(parts, axis=-1).reshape(n_rows, nb * BLOCK)
