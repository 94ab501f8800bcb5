"""What the GPU kernel tests share: random host weights at model shapes (kept between tests:
generating 50M elements takes a while) and readable parameter ids."""
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for test_dequant
from test_dequant import random_tensor  # noqa: E402

_WEIGHTS: dict = {}


def ID(v):
    if isinstance(v, T):
        return v.name
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(v)


def weights(qtype, n_rows, n_cols, seed=0):
    """Random bytes of an n_rows x n_cols `qtype` matrix, one row a line; the last few kept."""
    key = (qtype, n_rows, n_cols, seed)
    if key not in _WEIGHTS:
        if len(_WEIGHTS) > 4:
            _WEIGHTS.clear()
        rng = np.random.default_rng(seed)
        _WEIGHTS[key] = random_tensor(rng, qtype, (n_rows, n_cols)).reshape(n_rows, -1)
    return _WEIGHTS[key]
