"""Programmatic dependent launch (luce.kernels.pdl): which captured edges become
programmatic, the kernels marked ready for it, and the instructions they begin with when
it is on (sm_90 PTX, compiled offline); the graph itself runs in
tests/gpu/test_cuda_backend_synthetic_gpu.py::test_pdl_decode_matches_cpu."""
import numpy as np

from luce.kernels import pdl
from tests.ptx_background import assert_ptx_ok, background_ptx_check

K = ((4, 1, 1), (128, 1, 1))  # a kernel node's (grid, block)


def test_programmatic_edges_into_ready_kernels_only():
    # a copy, then four kernels; the third is not ready: the edge into it stays a full
    # dependency, the one out of it into a ready kernel does not
    order = [10, 11, 12, 13, 14]
    kinds = {10: "memcpy", 11: "kernel", 12: "kernel", 13: "kernel", 14: "kernel"}
    dims = {n: K for n in order[1:]}
    launches = [(True, *K), (True, *K), (False, *K), (True, *K)]
    assert pdl.programmatic_edges(order, kinds, dims, launches) == [(11, 12), (13, 14)]
    launches[2] = (True, *K)
    assert pdl.programmatic_edges(order, kinds, dims, launches) == [(11, 12), (12, 13), (13, 14)]


def test_programmatic_edges_need_the_launches_one_for_one():
    order = [1, 2, 3]
    kinds = dict.fromkeys(order, "kernel")
    dims = {1: K, 2: K, 3: ((8, 1, 1), (128, 1, 1))}
    ready = [(True, *K)] * 3
    assert pdl.programmatic_edges(order, kinds, dims, ready) == []  # a shape differs: not matched
    assert pdl.programmatic_edges(order, kinds, {n: K for n in order}, ready[:2]) == []  # a launch unseen
    assert pdl.programmatic_edges(None, kinds, dims, ready) == []  # not one chain
    assert pdl.programmatic_edges(order, kinds, {n: K for n in order}, ready) == [(1, 2), (2, 3)]
    assert pdl.dim3(5) == (5, 1, 1) and pdl.dim3((2, 3)) == (2, 3, 1)


def test_forward_kernels_are_marked_ready():
    """The kernels of decode (the products, qk_rope, attention and its combine, quantize_x
    and the first norm's), of verification (the tensor-core products and their x
    conversions, tree attention, the embedding's gather and dequantization, argmax) and of
    prefill (the matmul, its f16 conversion, RMSNorm) are marked; never on in the
    simulator."""
    import gguf
    from numba import cuda
    from luce.kernels import (attention, attention_mma, dequant, embedding, matmul, matvec_fast, matvec_mma, norm,
                              qk_rope, quantize_x, sampling)
    assert not pdl.ENABLED
    fn = lambda k: getattr(k, "py_func", None) or k.fn  # noqa: E731
    kernels = [matvec_fast._make_kernel(matvec_fast.T.Q4_K, False, False, False), qk_rope._make_kernel(True),
               attention._decode_kernel(32, 4, 1, *attention.decode_shape(32, 4)), attention._combine(32),
               quantize_x._quantize_kernel, quantize_x._norm_quantize_kernel,
               matvec_mma._kernel(gguf.GGMLQuantizationType.Q4_K, 1, 1, 1), matvec_mma._frags_kernel,
               matvec_mma._frags_fixup, matvec_mma._norm_frags_kernel, attention_mma.kernel(32, 1),
               embedding._gather_rows_u16_kernel, dequant._dequant_kernel(gguf.GGMLQuantizationType.Q4_K, 4, 1),
               sampling._argmax_kernel, matmul._to_f16_kernel, norm._rms_norm_kernel(1, 32),
               attention._attn_kernel(32, 4, 32)]  # the last: q8_0 KV's attention
    assert all(pdl.is_ready(fn(k)) for k in kernels), [k for k in kernels if not pdl.is_ready(fn(k))]

    @cuda.jit
    def plain(x):  # not marked: a full dependency
        x[0] = 1
    assert not pdl.is_ready(fn(plain))
    assert np.isfinite(pdl.grid_dependency_sync() or 0.0)  # the simulator's: nothing


PTX_CHECK = r'''
import re
from numba import cuda
from numba.cuda import types
from luce.kernels import pdl, quantize_x, qk_rope, attention, embedding, sampling, matvec_mma, matvec_fast as F
F1, F3 = types.float32[::1], types.float32[:, :, ::1]
cases = [(quantize_x._quantize_kernel, "void(float32[::1], uint8[::1], float32[::1], int64, int64)"),
         (attention._combine(128), "void(float32[:, :, :, ::1], float32[:, :, :, ::1], int64, int32[::1], "
                                   "float32[:, :, ::1], uint8[::1], float32[::1], uint16[::1], uint16[::1])"),
         # verification and prefill forwards' kernels
         (embedding._gather_rows_u16_kernel, "void(uint16[:, ::1], int32[::1], uint16[:, ::1])"),
         (sampling._argmax_kernel, "void(float32[:, ::1], int32[::1], float32[:, ::1], int32[:, ::1], int32[::1])"),
         (matvec_mma._frags_kernel, "void(float32[:, ::1], int64, int64, uint32[::1], int32[::1])")]
for on in (False, True):
    pdl.ENABLED = on  # read at compile time
    for k, sig in cases:
        ptx = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))[0]
        body = ptx[ptx.index(".entry"):]
        if not on:
            assert "griddepcontrol" not in body, k
            continue
        # the wait, then the trigger, before the kernel's first global access
        w, t = body.index("griddepcontrol.wait"), body.index("griddepcontrol.launch_dependents")
        first = min(m.start() for m in re.finditer(r"\b(ld|st|atom|red|cp\.async)\.global", body))
        assert w < t < first, k
print("PTX OK")
'''
ptx_check = background_ptx_check(PTX_CHECK)


def test_grid_dependency_sync_in_ptx(ptx_check):
    assert_ptx_ok(ptx_check)


PREFETCH_CHECK = r'''
import re
from numba import cuda
from numba.cuda import types
from luce.kernels import pdl, matvec_fast as F
u16, f32 = types.uint16[::1], types.float32[::1]
norm_args = (f32, f32, f32, types.int64, types.float32) + (u16, f32, f32) + (types.int64,) * 2 + (types.uint8[::1], f32)
sig = (u16, u16, u16, f32, f32, f32) + (types.int64,) * 4 + (f32, f32, types.int64) + norm_args
pdl.ENABLED = pdl.PREFETCH = True
ptx = cuda.compile_ptx(F._make_kernel(F.T.Q4_K, True, False, False, F.NW, True, None, 8, 1, 2).py_func, sig,
                       cc=(9, 0))[0]
body = ptx[ptx.index(".entry"):]
pf = [m.start() for m in re.finditer(r"cp\.async\.bulk\.prefetch\.L2\.global", body)]
w = body.index("griddepcontrol.wait")
assert len(pf) == 2 and max(pf) < w, (pf, w)  # gate and up, before the wait
print("PTX OK")
'''


def test_matvec_weight_prefetch_before_the_wait():
    """LUCE_PDL=2: the gated product (over int8 x) starts its first row block of gate and up
    weights toward L2 before it waits on the kernel before it (sm_90 PTX, offline)."""
    from luce.kernels.ptx import run_check
    r = run_check(PREFETCH_CHECK)
    assert r.returncode == 0 and "PTX OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


RECORDING_CHECK = r'''
from numba.cuda import dispatcher
from luce.backends.cuda_graph import _recording
from luce.kernels import pdl
calls = []
real = dispatcher._Kernel.launch
dispatcher._Kernel.launch = lambda self, *a: calls.append(a)  # stands in for the launch
try:
    class K:  # a compiled kernel, as numba hands it to launch
        pass
    ready, plain = K(), K()
    ready.py_func, plain.py_func = (lambda: None), (lambda: None)
    pdl.ready(ready)  # as a factory marks its dispatcher (the same py_func)
    launches = []
    with _recording(launches):
        dispatcher._Kernel.launch(ready, ["args"], (4, 2), 128, "stream", 0)
        dispatcher._Kernel.launch(plain, [], 7, (32, 2, 1), "stream", 64)
    assert launches == [(True, (4, 2, 1), (128, 1, 1)), (False, (7, 1, 1), (32, 2, 1))], launches
    assert calls == [(["args"], (4, 2), 128, "stream", 0), ([], 7, (32, 2, 1), "stream", 64)], calls
    dispatcher._Kernel.launch(plain, [], 1, 1, 0, 0)  # closed: not recorded
    assert len(launches) == 2 and len(calls) == 3
finally:
    dispatcher._Kernel.launch = real
print("PTX OK")
'''


def test_capture_records_numba_launches():
    """While a graph is captured with PDL on, every numba kernel launch is recorded (ready
    or not, grid and block as 3-tuples) and still made, in the same order; numba's
    launch is restored after (run with the real, not the simulated, numba.cuda)."""
    from luce.kernels.ptx import run_check
    r = run_check(RECORDING_CHECK)
    assert r.returncode == 0 and "PTX OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
