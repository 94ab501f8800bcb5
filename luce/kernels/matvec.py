"""Quantized matrix-vector products y = W x for decode, on raw GGUF weights.

A warp owns ROWS_PER_WARP weight rows. It stages a tile of each (whole blocks, ~2 KiB) into
shared memory with 16-byte loads (narrower when rows are not 16-byte aligned), then each
lane decodes units of the tiles into registers with the per-type device functions of
luce.kernels.dequant and multiplies them with x. The same kernel body serves every type,
the batched case (2..64 activation rows share each weight read), the bias/residual
epilogues and the fused SwiGLU (silu(Wg x) * (Wu x)).

Launches are eager and validate their arguments (tens of microseconds of host time);
decode should capture them in a CUDA graph (see bench_matvec's _capture). A call with an
x that is not 16-byte aligned allocates a copy, which a graph capture cannot do.

Batches beyond a few rows are bound by CUDA-core FMAs rather than memory (64 rows of Q4_K
would need ~1 PFLOP/s at full bandwidth); tensor cores are the way there, not this kernel.
"""
from __future__ import annotations

import math
import time

import numpy as np
from numba import cuda

from . import disk_cache
from .device import device, fma
from .dequant import (
    DEVICE_SPECS, SIM, as_device, as_qtype, dequantize, load_width, make_stage, row_bytes, tile_step,
    warp_barrier, weight_u16,
)
from ._reduce import WARP_RED_SLOTS, warp_sum
from .vector_load import ldg_f32x4

__all__ = ["MATVEC_TYPES", "MAX_BATCH", "matvec", "swiglu", "matvec_ref", "swiglu_ref", "bench_matvec",
           "BENCH_SHAPES", "BENCH_TYPES"]

MATVEC_TYPES = frozenset(DEVICE_SPECS)
MAX_BATCH = 64
MV_WARPS = 4  # warps per thread block
# Weight rows per warp: each x load serves this many rows, halving the L1 traffic of x,
# which at one row per warp is 8x the weight bytes of Q4_K. Tune with bench_matvec.
ROWS_PER_WARP = 2

_dev = device  # plain Python in the simulator where it can be: see luce.kernels.device

RED_SIZE = max(1, MV_WARPS * WARP_RED_SLOTS)


@_dev
def silu(y):
    e = math.exp(-abs(y))  # never overflows
    return y / (np.float32(1.0) + e) if y >= 0 else y * e / (np.float32(1.0) + e)


def _batch_slots(nr: int) -> int:
    """Compiled batch width for nr rows: the next power of two (padding rows repeat the
    last row and are not stored). Seven widths, all compiled at load by the CUDA
    backend's warm-up: with multiples of 8, a 42-token prompt met an uncompiled width and
    its first request waited ~10 s for kernels (H200, SmolLM2 served on CUDA)."""
    return 1 << (nr - 1).bit_length()


def _make_rows_dot(qtype, vw: int, tb: int, nr_slots: int, rpw: int):
    spec = DEVICE_SPECS[qtype]
    QK, BS, UPB, RUNS, NQ = spec.qk, spec.bs, spec.upb, spec.runs, spec.rl // 4
    BH = BS // 2
    NR, R = nr_slots, rpw
    SW = tb * BS // 4 + 4  # words per staged row, padded for reads past a tile's last block
    SWB = 4 * SW
    col, scale, quad = spec.col, spec.scale, spec.quad
    stage = make_stage(vw, tb * BS, R)

    @_dev
    def rows_dot(w, rows, row_h, blocks_row, x, xo, sh, s0, red, wid, lane, acc):
        """acc[i * NR + r] = (row rows[i] of w) . x[xo[r]:] for i < R, r < NR; the full sums
        end in lane 0. Each x load serves the R rows."""
        h0 = cuda.local.array(R, np.int64)
        sc = cuda.local.array(R, np.float32)
        of = cuda.local.array(R, np.float32)
        v = cuda.local.array((R, 4), np.float32)
        for i in range(R * NR):
            acc[i] = np.float32(0.0)
        for t0 in range(0, blocks_row, tb):
            nb = min(tb, blocks_row - t0)
            for i in range(R):
                h0[i] = rows[i] * row_h + t0 * BH
            stage(w, h0, nb * BS, sh, s0, SW, lane)
            warp_barrier()
            for ub in range(lane, nb * UPB, 32):
                b = ub // UPB
                u = ub - b * UPB
                bo = 4 * s0 + b * BS
                c0 = (t0 + b) * QK
                for k in range(RUNS):
                    for i in range(R):
                        sc[i], of[i] = scale(sh, bo + i * SWB, u, k)
                    c = c0 + col(u, k)
                    for j in range(NQ):
                        for i in range(R):
                            q = quad(sh, bo + i * SWB, u, k, j)
                            for e in range(4):
                                v[i, e] = fma(sc[i], q[e], of[i])
                        for r in range(NR):
                            x0, x1, x2, x3 = ldg_f32x4(x, xo[r] + c + 4 * j)
                            for i in range(R):
                                acc[i * NR + r] += v[i, 0] * x0 + v[i, 1] * x1 + v[i, 2] * x2 + v[i, 3] * x3
            warp_barrier()  # the next tile overwrites sh
        for i in range(R * NR):
            acc[i] = warp_sum(acc[i], red, wid, lane)
    return rows_dot, SW


def _make_kernel(qtype, vw: int, tb: int, nr_slots: int, rpw: int, glu: bool, has_bias: bool, has_res: bool):
    NW, NR, R = MV_WARPS, nr_slots, rpw
    ACC = R * NR
    rows_dot, SW = _make_rows_dot(qtype, vw, tb, nr_slots, rpw)
    SH = NW * R * SW
    RED = RED_SIZE

    @cuda.jit
    def kernel(w, w_up, x, out, bias, res, n_rows, row_h, blocks_row, n_cols, nr):
        sh = cuda.shared.array(SH, np.uint32)
        red = cuda.shared.array(RED, np.float32)
        lane = cuda.threadIdx.x & 31
        wid = cuda.threadIdx.x >> 5
        row0 = (cuda.blockIdx.x * NW + wid) * R
        # Rows past the end repeat the last row (and are not stored): every warp runs the
        # same loop, as the simulator's block-wide barriers need.
        rows = cuda.local.array(R, np.int64)
        for i in range(R):
            rows[i] = min(row0 + i, n_rows - 1)
        xo = cuda.local.array(NR, np.int64)
        for r in range(NR):
            xo[r] = min(r, nr - 1) * n_cols
        acc = cuda.local.array(ACC, np.float32)
        rows_dot(w, rows, row_h, blocks_row, x, xo, sh, wid * R * SW, red, wid, lane, acc)
        up = cuda.local.array(ACC, np.float32)
        if glu:
            rows_dot(w_up, rows, row_h, blocks_row, x, xo, sh, wid * R * SW, red, wid, lane, up)
        if lane == 0:
            for i in range(R):
                row = row0 + i
                if row < n_rows:
                    for r in range(NR):
                        if r < nr:
                            y = acc[i * NR + r]
                            if glu:
                                y = silu(y) * up[i * NR + r]
                            if has_bias:
                                y += bias[row]
                            if has_res:
                                y += res[r * n_rows + row]
                            out[r * n_rows + row] = y
    return disk_cache.enable(kernel)


_KERNELS: dict = {}
_DUMMY: dict = {}


def _kernel(*key):
    if key not in _KERNELS:
        _KERNELS[key] = _make_kernel(*key)
    return _KERNELS[key]


def _dummy():
    """A 1-element device array standing in for absent bias/residual arguments."""
    if "f32" not in _DUMMY:
        _DUMMY["f32"] = cuda.to_device(np.zeros(1, np.float32))
    return _DUMMY["f32"]


def _flat_f32(a, what: str, size: int | None = None):
    a = as_device(a)
    if a.dtype != np.float32:
        raise ValueError(f"{what}: expected float32, got {a.dtype}")
    if size is not None and a.size != size:
        raise ValueError(f"{what}: expected {size} elements, got shape {tuple(a.shape)}")
    if not a.is_c_contiguous():
        raise ValueError(f"{what}: must be C-contiguous")
    return a.reshape(a.size)


def _launch(w_list, qtype, x_dev, out, bias, residual, stream, tile_blocks, rows_per_warp):
    qtype = as_qtype(qtype)
    if qtype not in MATVEC_TYPES:
        raise NotImplementedError(f"matvec: {qtype.name} is not supported")
    spec = DEVICE_SPECS[qtype]
    x_dev = as_device(x_dev)
    xshape = tuple(x_dev.shape)  # the simulator's shape objects lack negative indexing
    if len(xshape) not in (1, 2):
        raise ValueError(f"x must be (K,) or (batch, K), got {xshape}")
    n_cols = xshape[-1]
    nr = 1 if len(xshape) == 1 else xshape[0]
    if not 1 <= nr <= MAX_BATCH:
        raise ValueError(f"batch of {nr} rows: 1..{MAX_BATCH} supported")
    if n_cols % spec.qk:
        raise ValueError(f"{qtype.name}: {n_cols} columns is not a multiple of {spec.qk} on the device")
    ws = [weight_u16(w, qtype, n_cols) for w in w_list]
    n_rows = ws[0][1]
    if any(r != n_rows for _, r in ws):
        raise ValueError("gate and up weights differ in rows")
    x = _flat_f32(x_dev, "x")
    if not SIM and x.__cuda_array_interface__["data"][0] % 16:
        x = _aligned_copy(x, stream)
    out_shape = (n_rows,) if len(xshape) == 1 else (nr, n_rows)
    if out is None:
        out = cuda.device_array(out_shape, np.float32, stream=stream)
    out_flat = _flat_f32(out, "out", nr * n_rows)
    b = _flat_f32(bias, "bias", n_rows) if bias is not None else _dummy()
    r = _flat_f32(residual, "residual", nr * n_rows) if residual is not None else _dummy()
    tb = tile_blocks or spec.tile_blocks
    if tb % tile_step(qtype):
        raise ValueError(f"tile_blocks must be a multiple of {tile_step(qtype)} for {qtype.name}")
    rb = row_bytes(qtype, n_cols)
    rpw = rows_per_warp or ROWS_PER_WARP
    vw = min(load_width(rb, w) for w, _ in ws)
    kern = _kernel(qtype, vw, tb, _batch_slots(nr), rpw, len(ws) == 2, bias is not None,
                   residual is not None)
    grid = -(-n_rows // (MV_WARPS * rpw))
    w0 = ws[0][0]
    w1 = ws[1][0] if len(ws) == 2 else w0
    kern[grid, 32 * MV_WARPS, stream](w0, w1, x, out_flat, b, r, n_rows, rb // 2, n_cols // spec.qk, n_cols, nr)
    return out


def _aligned_copy(x, stream):
    """16-byte loads of x need a 16-byte aligned start; a fresh allocation has one."""
    y = cuda.device_array(x.shape, x.dtype, stream=stream)
    y.copy_to_device(x, stream=stream)
    return y


def matvec(w_dev, qtype, x_dev, out=None, bias=None, residual=None, stream=0, *, tile_blocks=None,
           rows_per_warp=None):
    """out = W x (+ bias) (+ residual), float32.

    w_dev: raw GGUF bytes of W (N rows x K columns) as a uint8 device array (N, row_bytes).
    x_dev: float32 (K,) or (batch, K) with batch <= 64; the batched form reads W once for
    all rows and gives out (batch, N). bias: (N,); residual: shaped like out, and may be out
    itself (h += W x). Any array with
    __cuda_array_interface__ is accepted. tile_blocks / rows_per_warp override the tuning
    defaults (DEVICE_SPECS[qtype].tile_blocks, ROWS_PER_WARP).
    """
    return _launch([w_dev], qtype, x_dev, out, bias, residual, stream, tile_blocks, rows_per_warp)


def swiglu(w_gate, w_up, qtype, x_dev, out=None, stream=0, *, tile_blocks=None, rows_per_warp=None):
    """out = silu(Wg x) * (Wu x), Wg and Wu of the same type and shape; x as in matvec."""
    return _launch([w_gate, w_up], qtype, x_dev, out, None, None, stream, tile_blocks, rows_per_warp)


# ---------------------------------------------------------------------------------------
# numpy references
# ---------------------------------------------------------------------------------------
def _ref_weight(raw, qtype, n_cols):
    raw = np.asarray(raw).reshape(-1).view(np.uint8)
    n_rows = raw.size // row_bytes(qtype, n_cols)
    return dequantize(raw, qtype, (n_rows, n_cols))


def matvec_ref(raw, qtype, x, bias=None, residual=None):
    """dequantize(raw) @ x (x: (K,) or (batch, K)) with the same epilogues, in float64 then float32."""
    x = np.asarray(x, np.float32)
    w = _ref_weight(raw, qtype, x.shape[-1]).astype(np.float64)
    y = x.astype(np.float64) @ w.T
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    if residual is not None:
        y = y + np.asarray(residual, np.float64)
    return y.astype(np.float32)


def swiglu_ref(raw_gate, raw_up, qtype, x):
    g = matvec_ref(raw_gate, qtype, x).astype(np.float64)
    u = matvec_ref(raw_up, qtype, x).astype(np.float64)
    return (g * np.exp(-np.logaddexp(0.0, -g)) * u).astype(np.float32)  # sigmoid without overflow


# ---------------------------------------------------------------------------------------
# benchmark
# ---------------------------------------------------------------------------------------
def _capture(launch, stream, n):
    """A CUDA graph of n launches on stream: numba's host launch cost (~50 us) exceeds
    these kernels' run time, so eager back-to-back launches would time the host."""
    from cuda.bindings import driver as drv

    h = drv.CUstream(int(stream.handle))
    err, = drv.cuStreamBeginCapture(h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamBeginCapture: {err}")
    try:
        for _ in range(n):
            launch()
    finally:
        err, graph = drv.cuStreamEndCapture(h)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamEndCapture: {err}")
    err, gexec = drv.cuGraphInstantiate(graph, 0)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuGraphInstantiate: {err}")

    def replay():
        err, = drv.cuGraphLaunch(gexec, h)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuGraphLaunch: {err}")
    return replay


def time_launch(launch, stream, iters):
    """(us a launch, "graph" or why eager, compile seconds): one launch to compile, then
    iters launches replayed from a CUDA graph (eager where capture fails), warmed once and
    timed between two events."""
    t0 = time.perf_counter()
    launch()
    stream.synchronize()
    compile_s = time.perf_counter() - t0
    try:
        run, timing = _capture(launch, stream, iters), "graph"
    except Exception as e:  # noqa: BLE001 - fall back to eager timing, say so
        def run():
            for _ in range(iters):
                launch()
        timing = f"eager ({type(e).__name__})"
    run()
    stream.synchronize()
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    run()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters, timing, compile_s


# Decode-time projections of a Qwen3-8B-sized layer (rows, columns) and the types GGUF
# files use for them.
BENCH_SHAPES = ((4096, 12288), (12288, 4096), (4096, 4096))
BENCH_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")


def bench_matvec(shapes=BENCH_SHAPES, qtypes=BENCH_TYPES, batch: int = 1, iters: int = 100, glu: bool = False, seed: int = 0,
                 rows_per_warp: int | None = None, tile_blocks: int | None = None) -> list[dict]:
    """Time matvec (or swiglu with glu=True) for each (rows, cols) in shapes and each qtype.

    Weights are random bytes (timing does not depend on values). Each row reports time_us
    per call from cuda events around a replayed CUDA graph of `iters` launches (eager
    launches as fallback, noted in "timing"), and "GB/s" = weight bytes / time.
    """
    rng = np.random.default_rng(seed)
    stream = cuda.stream()
    rows = []
    for n_rows, n_cols in shapes:
        x = cuda.to_device(rng.standard_normal((batch, n_cols) if batch > 1 else n_cols).astype(np.float32))
        out = cuda.device_array((batch, n_rows) if batch > 1 else n_rows, np.float32)
        for qtype in qtypes:
            qtype = as_qtype(qtype)
            rb = row_bytes(qtype, n_cols)
            ws = [cuda.to_device(rng.integers(0, 256, (n_rows, rb), dtype=np.uint8)) for _ in range(1 + glu)]
            if glu:
                def launch():
                    swiglu(ws[0], ws[1], qtype, x, out=out, stream=stream, rows_per_warp=rows_per_warp,
                           tile_blocks=tile_blocks)
            else:
                def launch():
                    matvec(ws[0], qtype, x, out=out, stream=stream, rows_per_warp=rows_per_warp,
                           tile_blocks=tile_blocks)
            us, timing, compile_s = time_launch(launch, stream, iters)
            nbytes = rb * n_rows * len(ws)
            rows.append({"kernel": "swiglu" if glu else "matvec", "qtype": qtype.name, "rows": n_rows,
                         "cols": n_cols, "batch": batch, "rows_per_warp": rows_per_warp or ROWS_PER_WARP,
                         "tile_blocks": tile_blocks or DEVICE_SPECS[qtype].tile_blocks,
                         "weight_bytes": nbytes, "time_us": round(us, 2),
                         "GB/s": round(nbytes / (us * 1e-6) / 1e9, 1), "timing": timing,
                         "compile_s": round(compile_s, 2)})
            del ws
    return rows
