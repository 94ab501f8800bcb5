"""What int8 activations (LUCE_MATVEC_X8) do to greedy output on a real Q4_K_M model,
measured on the CPU, where the trained models are.

The CPU backend with the GPU's x8 arithmetic emulated in numpy (luce.kernels.quantize_x's
rounding; Q4_K: the scaled quants times the rounded x, the mins times the exact x; Q6_K:
all of W times the rounded x) for forwards of up to FAST_MATVEC_MAX_ROWS tokens, as the CUDA
backend routes them, against the plain float32 CPU backend: greedy, the same prompts.
Reports per prompt the first position where the tokens differ (and the float run's gap
between its two top logits there), the smallest such gap of the run, and how far the
logits moved (relative L2) over the steps both runs were fed the same tokens.

    python -m luce.bench.x8_drift --categories code --max-tokens 48 [--planes 2]

--planes 2: x in two int8 planes (x, then what its rounding left; LUCE_MATVEC_X8=2), about
int16's precision.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from ..backends.cpu import CPUBackend, NumpyOps
from ..backends.cuda import FAST_MATVEC_MAX_ROWS


class X8Ops(NumpyOps):
    """NumpyOps whose Q4_K/Q6_K projections of short forwards take int8-rounded x."""

    def __init__(self, backend: "X8CPUBackend"):
        self.b = backend

    def linear(self, x, w, bias=None, residual=None):
        if not (self.b.enabled and x.shape[0] <= FAST_MATVEC_MAX_ROWS and id(w) in self.b.meta):
            return NumpyOps.linear(x, w, bias, residual)
        from ..kernels.quantize_x import dequantize_x_ref, quantize_x_ref
        xf = np.ascontiguousarray(x, np.float32)
        planes = self.b.planes
        xh = dequantize_x_ref(quantize_x_ref(xf, planes), xf.shape[-1], planes).astype(np.float32)
        y = NumpyOps.linear(xh, w, bias, residual)
        exact = self.b.meta[id(w)]
        if exact is not None:  # the part of W that meets the exact x (Q4_K's mins, Q6_K's -32 offset)
            y += (xf - xh).reshape(xf.shape[0], exact.shape[1], -1).sum(-1) @ exact.T
        return y

    def gated_linear(self, x, w_gate, w_up):
        return self.swiglu(self.linear(x, w_gate), self.linear(x, w_up))


class X8CPUBackend(CPUBackend):
    """The CPU backend, remembering which weights are Q4_K / Q6_K; `enabled` switches the
    emulation (one load serves both runs)."""

    def __init__(self, types=("Q4_K", "Q6_K"), planes: int = 1):
        super().__init__()
        self.planes = planes  # int8 planes of x (quantize_x's rounding, what the GPU runs)
        # id(weight) -> the part of W constant over column groups that the units multiply with
        # the exact x ([rows, groups]: Q4_K's mins a 32 columns, Q6_K's -32 d scale a 16)
        self.meta: dict = {}
        self.enabled = False
        self.types = set(types)  # which weight types take int8 x (the GPU has units for both)

    def load_tensor(self, info):
        import gguf
        from ..kernels.dequant import dequantize
        Q = gguf.GGMLQuantizationType
        w = super().load_tensor(info)
        if len(info.shape) == 2 and info.qtype in (Q.Q4_K, Q.Q6_K) and Q(info.qtype).name in self.types:
            exact = None
            if info.qtype == Q.Q4_K:  # d = 0 leaves -dmin * min, constant over each 32 columns
                raw = np.array(info.data, np.uint8).reshape(info.shape[0], -1, 144)
                raw[:, :, 0:2] = 0
                exact = dequantize(raw.reshape(-1), info.qtype, info.shape)[:, ::32].copy()
            else:  # Q6_K: quants 0 leave -32 d scale, constant over each 16 columns
                raw = np.array(info.data, np.uint8).reshape(info.shape[0], -1, 210)
                raw[:, :, :192] = 0
                exact = dequantize(raw.reshape(-1), info.qtype, info.shape)[:, ::16].copy()
            self.meta[id(w)] = exact
        return w

    def ops_for(self, family):
        return X8Ops(self)


def run(model_path=None, categories=("code",), max_tokens: int = 48, n_ctx: int = 1024, types=("Q4_K", "Q6_K"),
        echo=print, planes: int = 1) -> list[dict]:
    from ..model import Model
    from .spec import _prompt_ids, default_pair, load_prompts
    path = model_path or default_pair()[0]
    be = X8CPUBackend(types, planes)
    t0 = time.perf_counter()
    model = Model(path, backend=be, n_ctx=n_ctx)
    echo(f"{model.path.name} loaded in {time.perf_counter() - t0:.1f}s; {len(be.meta)} Q4_K/Q6_K matrices")
    rows = []
    for row in load_prompts(categories=categories):
        ids = _prompt_ids(model, row)
        runs = {}
        for enabled in (False, True):
            be.enabled = enabled
            runs[enabled] = _greedy(model, ids, max_tokens, n_ctx)
        (a, ma, la), (b, _, lb) = runs[False], runs[True]
        first = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), None)
        same = len(a) if first is None else first + 1  # steps fed the same tokens: logits comparable
        rel = [float(np.linalg.norm(lb[i] - la[i]) / np.linalg.norm(la[i])) for i in range(same)]
        r = {"id": row["id"], "category": row["category"], "tokens": len(a), "first_difference": first,
             "float_margin_there": None if first is None else round(float(ma[first]), 4),
             "smallest_float_margin": round(float(min(ma)), 4),
             "logits_rel_l2_median": float(f"{np.median(rel):.3g}"), "logits_rel_l2_max": float(f"{max(rel):.3g}")}
        rows.append(r)
        echo(r)
    return rows


def _greedy(model, ids, max_tokens, n_ctx):
    """Greedy tokens, per step the gap between the two largest logits, and the logits."""
    s = model.new_session(n_ctx)
    logits, _ = s.prefill(list(ids))
    toks, margins, seen = [], [], []
    for _ in range(max_tokens):
        top2 = np.partition(logits, -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
        seen.append(np.array(logits, np.float32))
        t = int(np.argmax(logits))
        toks.append(t)
        logits = s.decode(t)
    return toks, margins, seen


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: Qwen2.5-Coder-1.5B, Q4_K/Q6_K)")
    ap.add_argument("--categories", default="code")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--types", default="Q4_K,Q6_K", help="weight types whose projections take int8 x")
    ap.add_argument("--planes", type=int, choices=(1, 2), default=1, help="int8 planes of x (LUCE_MATVEC_X8)")
    a = ap.parse_args()
    run(a.model, tuple(a.categories.split(",")), a.max_tokens, types=tuple(a.types.split(",")), planes=a.planes)
