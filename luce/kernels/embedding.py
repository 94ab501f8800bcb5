"""Embedding gather."""
from __future__ import annotations

import numpy as np


def embed_ref(table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return table[np.asarray(tokens, dtype=np.int64)].astype(np.float32, copy=False)
