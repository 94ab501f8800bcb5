"""The CUDA backend's fusions in numba's simulator, each against the unfused run: decode's
split norms, int8 activations, the paired q/k projections, the K/V write in qk_rope and
qk_rope in decode attention. Apart from tests/test_cuda_backend_sim.py (whose model_file
they use) so that CI's two workers (pytest-xdist, by file) share the simulator's slowest
tests."""
import numpy as np
import pytest

from tests.test_cuda_backend_sim import model_file


def test_split_norms_in_decode(tmp_path, monkeypatch):
    """FUSED_NORM: in a decode step the norms after the o and down projections (the next
    layer's and the output norm too) have no launch of their own: the residual products
    store x w and the sums of squares, their readers (q/k paired, v, gate/up, the head)
    finish the norm. Two layers (a norm read after new_layer): the logits as with
    FUSED_NORM off, which launches every norm, and as the CPU's."""
    import gguf
    from luce.backends import cuda as C
    from luce.backends.cpu import CPUBackend
    from luce.kernels import norm as N
    from luce.models.transformer import build_weights
    f, fam, cfg = model_file(tmp_path / "t.gguf", "qwen3", gguf.GGMLQuantizationType.Q8_0, seed=5, n_layers=2)
    launches = []
    norm = N.rms_norm_cuda
    monkeypatch.setattr(N, "rms_norm_cuda", lambda *a, **k: launches.append(1) or norm(*a, **k))
    cpu = CPUBackend()
    want = cpu.forward(fam, cfg, build_weights(cfg, f, cpu.load_tensor), cpu.new_cache(cfg, 16), [9], [0])
    gpu = C.CUDABackend(use_graphs=False)
    wg, kg = build_weights(cfg, f, gpu.load_tensor), gpu.new_cache(cfg, 16)
    got = {}
    for fused in (True, False):  # the same step twice (nothing committed)
        monkeypatch.setattr(C, "FUSED_NORM", fused)
        del launches[:]
        got[fused] = gpu.forward(fam, cfg, wg, kg, [9], [0])
        kg.commit([])
        assert len(launches) == (1 if fused else 1 + 2 * cfg.n_layers)
        np.testing.assert_allclose(got[fused], want, rtol=2e-3, atol=2e-3)  # f16 KV on the device
    np.testing.assert_allclose(got[True], got[False], rtol=1e-5, atol=1e-5 * np.abs(got[False]).max())


@pytest.mark.parametrize("planes,x8_out", [(2, {"norm", "gated", "attn"}), (1, {"norm", "attn"}), (1, set())])
def test_int8_activations_in_simulator(tmp_path, monkeypatch, planes, x8_out):
    """LUCE_MATVEC_X8's wiring: a decode step's Q4_K projections read int8 x made by the
    first norm (rms_norm_quantize: q, k and v share one), by the split norms' residual
    products (o and down store the next norm's xg in int8 form too: gate and up, the head),
    by gate/up's launch (down's) and by the attention kernel (o's), or by quantize_x where
    LUCE_X8_OUT leaves them out, in the planes asked for, and
    the logits stay within int8 rounding of the CPU's (relative L2 below 2e-2, the GPU
    test's bound; with two planes below 2e-3, the float path's own tolerance here)."""
    import gguf
    from luce.backends import cuda as cuda_backend
    from luce.backends.cpu import CPUBackend
    from luce.kernels import matvec_fast as mf, quantize_x as qx
    from luce.models.transformer import build_weights
    f, fam, cfg = model_file(tmp_path / "q4k.gguf", "qwen3", gguf.GGMLQuantizationType.Q4_K, seed=9, n_embd=256,
                             n_ff=256, head_dim=128)
    monkeypatch.setattr(cuda_backend, "MATVEC_X8", planes)
    monkeypatch.setattr(cuda_backend, "X8_OUT", x8_out)
    seen = {"xq": 0, "quantize": 0, "norm": 0, "xq_out": 0}
    asked = set()
    launch, quantize, norm_quantize = mf._launch, qx.quantize_x, qx.rms_norm_quantize

    def spy_launch(*a, **k):
        seen["xq"] += a[-1] is not None if len(a) >= 13 else k.get("xq") is not None
        seen["xq_out"] += k.get("xq_out") is not None
        return launch(*a, **k)

    def spy_quantize(*a, **k):
        seen["quantize"] += 1
        asked.add(k.get("planes"))
        return quantize(*a, **k)

    def spy_norm(*a, **k):
        seen["norm"] += 1
        asked.add(k.get("planes"))
        return norm_quantize(*a, **k)
    monkeypatch.setattr(mf, "_launch", spy_launch)
    monkeypatch.setattr(qx, "quantize_x", spy_quantize)
    monkeypatch.setattr(qx, "rms_norm_quantize", spy_norm)
    cpu, gpu = CPUBackend(), cuda_backend.CUDABackend(use_graphs=False)
    wc, wg = build_weights(cfg, f, cpu.load_tensor), build_weights(cfg, f, gpu.load_tensor)
    kc, kg = cpu.new_cache(cfg, 16), gpu.new_cache(cfg, 16)
    for tokens, pos in [([9], [0])]:  # one decode step (a simulated one costs ~30 s here)
        seen.update(xq=0, quantize=0, norm=0, xq_out=0)
        a = cpu.forward(fam, cfg, wc, kc, tokens, pos, None, [len(tokens) - 1])
        b = gpu.forward(fam, cfg, wg, kg, tokens, pos, None, [len(tokens) - 1])
        kc.commit()
        kg.commit()
        rel = np.linalg.norm(b - a, axis=-1) / np.linalg.norm(a, axis=-1)
        assert rel.max() < (2e-2 if planes == 1 else 2e-3), rel.max()
    assert asked == {planes}
    # the decode step: q with k and v (one launch), o, gate/up, down and the output head
    # (all Q4_K here) over int8 x from five inputs: three norms' outputs (one launch of its
    # own, two from o and down), the gated one (from gate/up's launch) and the attention's
    # (quantize_x)
    # (without "gated" or "attn" in LUCE_X8_OUT, that one by quantize_x; =0: three norm
    # launches, two quantize_x)
    want = {"xq": 5, "norm": 3 - 2 * ("norm" in x8_out), "quantize": 2 - ("gated" in x8_out) - ("attn" in x8_out),
            "xq_out": 2 * ("norm" in x8_out) + ("gated" in x8_out)}
    assert seen == want, seen


def test_paired_projections_same_logits(tmp_path, monkeypatch):
    """Decode's q and k projections in one launch (PAIR_PROJECTIONS), and v with them
    (TRIO_PROJECTIONS), give the logits the separate launches give, bit for bit (the
    simulator's grid is the same for all), on a Q8_0 model with q/k/v biases (qwen2)."""
    import gguf
    from luce.backends import cuda as cuda_backend
    from luce.models.transformer import build_weights
    f, fam, cfg = model_file(tmp_path / "q2.gguf", "qwen2", gguf.GGMLQuantizationType.Q8_0, seed=4)
    gpu = cuda_backend.CUDABackend(use_graphs=False)
    w = build_weights(cfg, f, gpu.load_tensor)
    assert w.layers[0].bq is not None and w.layers[0].bk is not None
    from luce.kernels import matvec_fast as mf
    calls = []
    pair_fn = mf.matvec_fast_pair
    monkeypatch.setattr(mf, "matvec_fast_pair",
                        lambda *a, **k: calls.append(k.get("third") is not None) or pair_fn(*a, **k))
    logits = []
    for pair, trio in ((True, True), (True, False), (False, True)):
        monkeypatch.setattr(cuda_backend, "PAIR_PROJECTIONS", pair)
        monkeypatch.setattr(cuda_backend, "TRIO_PROJECTIONS", trio)
        kv = gpu.new_cache(cfg, 16)
        logits.append(gpu.forward(fam, cfg, w, kv, [5], [0], None, [0]))
    assert calls == [True, False]  # one layer: with v, then without; none when not asked for
    np.testing.assert_array_equal(logits[0], logits[2])
    np.testing.assert_array_equal(logits[1], logits[2])


def _prefill_then_decode(fam, cfg, f, steps, n_rows):
    """On a fresh CUDA backend (no graphs): a prefill of two tokens, then one decode step a
    (token, position) of steps; the logits of each, then the pools' and positions' first
    n_rows rows."""
    from luce.backends.cuda import CUDABackend
    from luce.models.transformer import build_weights
    gpu = CUDABackend(use_graphs=False)
    wg, kg = build_weights(cfg, f, gpu.load_tensor), gpu.new_cache(cfg, 32)
    out = [gpu.forward(fam, cfg, wg, kg, [3, 17], [0, 1], None, [1])]
    kg.commit()
    for tok, pos in steps:
        out.append(gpu.forward(fam, cfg, wg, kg, [tok], [pos]))
        kg.commit()
    return out + [kg.k_pool.copy_to_host()[:, :, :, :n_rows], kg.v_pool.copy_to_host()[:, :, :, :n_rows],
                  kg.pos_d.copy_to_host()[:n_rows]]


def test_fused_kv_write_same_logits(tmp_path, monkeypatch):
    """FUSED_KV_WRITE: qk_rope stores each layer's new K and V rows, so no write_kv launch
    runs, in a prefill and a decode step; the logits and the pool are the unfused run's,
    bit for bit (two layers: the write goes to the layer attention reads)."""
    import gguf
    from luce.backends import cuda as C
    from luce.kernels import paging
    f, fam, cfg = model_file(tmp_path / "t.gguf", "qwen3", gguf.GGMLQuantizationType.Q8_0, seed=6, n_layers=2)
    writes = []
    write = paging.write_kv_cuda
    monkeypatch.setattr(paging, "write_kv_cuda", lambda *a, **k: writes.append(1) or write(*a, **k))
    runs = {}
    monkeypatch.setattr(C, "FUSED_ROPE", False)  # decode's rotation in attention: the test below
    for fused in (True, False):
        monkeypatch.setattr(C, "FUSED_KV_WRITE", fused)
        del writes[:]
        runs[fused] = _prefill_then_decode(fam, cfg, f, [(9, 2)], 3)
        assert len(writes) == (0 if fused else 2 * cfg.n_layers)
    for a, b in zip(runs[True], runs[False]):
        np.testing.assert_array_equal(a, b)


def test_fused_rope_in_decode_attention(tmp_path, monkeypatch):
    """FUSED_ROPE: in a decode step qk_rope launches nothing and the attention kernel norms
    and rotates q and k and stores the new K/V rows; prefill (two tokens) keeps qk_rope's
    launch. Logits and pools as without it, to float32 rounding (the norm's sum is taken
    in another order) and the pool's f16 step; two layers, two decode steps."""
    import gguf
    from luce.backends import cuda as C
    from luce.kernels import qk_rope as QR
    # Qwen3 (q/k norms); without norms: tests/kernels/test_attention.py's rope cases
    f, fam, cfg = model_file(tmp_path / "t.gguf", "qwen3", gguf.GGMLQuantizationType.Q8_0, seed=7, n_layers=2)
    launches = []
    real = QR.qk_rope_cuda
    monkeypatch.setattr(QR, "qk_rope_cuda", lambda *a, **k: launches.append(a[0].shape[0]) or real(*a, **k))
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(C, "FUSED_ROPE", fused)
        del launches[:]
        runs[fused] = _prefill_then_decode(fam, cfg, f, [(9, 2), (4, 3)], 4)
        # the prefill's launches only (one a layer), or the decode steps' too
        assert launches == [2] * cfg.n_layers + ([] if fused else [1] * 2 * cfg.n_layers), launches
    np.testing.assert_array_equal(runs[True][-1], [0, 1, 2, 3])
    for a, b in zip(runs[True], runs[False]):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-5)


def test_long_context_decode_on_tensor_cores(tmp_path, monkeypatch):
    """LUCE_DECODE_ATTN=auto: decode steps over DECODE_LONG_KEYS+ committed keys (lowered
    to 3 here) take the tensor-core attention kernel, the ones before the one-query kernel;
    logits as with the one-query kernel throughout, to float32 rounding."""
    import gguf
    from luce.kernels import attention as A
    from luce.kernels import attention_mma as M
    f, fam, cfg = model_file(tmp_path / "t.gguf", "qwen3", gguf.GGMLQuantizationType.Q8_0, seed=8, n_layers=2)
    monkeypatch.setattr(M, "DECODE_LONG_KEYS", 3)
    kinds = []
    launch = A.paged_attention_cuda

    def record(q, k_pool, *a, **kw):
        kinds.append(A.attention_plan(q.shape[0], q.shape[1], k_pool.shape[2], q.shape[2], kw["n_keys"],
                                      long=kw.get("long", False)).get("kind"))
        return launch(q, k_pool, *a, **kw)
    monkeypatch.setattr(A, "paged_attention_cuda", record)
    runs = {}
    for mode in ("auto", "row"):
        monkeypatch.setattr(M, "DECODE", mode)
        del kinds[:]
        runs[mode] = _prefill_then_decode(fam, cfg, f, [(9, 2), (4, 3)], 4)
        # the prefill's tiles, a step over 2 committed keys, one over 3
        last = "mma" if mode == "auto" else "row"
        assert kinds == ["mma"] * cfg.n_layers + ["row"] * cfg.n_layers + [last] * cfg.n_layers, kinds
    for a, b in zip(runs["auto"], runs["row"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_long_context_tree_keeps_q_in_shared_memory(tmp_path, monkeypatch):
    """A verification tree over DECODE_LONG_KEYS+ committed keys (lowered to 3 here) runs
    with attention's long-context plan, which keeps its Q fragments in shared memory
    (attention_mma.plan's qsh), a decode step over fewer keys with the short one; the
    tree's logits are those of the same forward with Q in registers (LUCE_ATTN_Q_SHARED=0),
    bit for bit: the same values into the same mma, over the same single split."""
    import gguf
    from luce.backends.cuda import CUDABackend
    from luce.kernels import attention as A
    from luce.kernels import attention_mma as M
    from luce.kernels.attention import tree_mask
    from luce.models.transformer import build_weights
    # 4 query heads a kv head: a 5-node tree is 20 rows, two simulated warps in one tile
    f, fam, cfg = model_file(tmp_path / "t.gguf", "qwen3", gguf.GGMLQuantizationType.Q8_0, seed=9, n_heads=4)
    monkeypatch.setattr(M, "DECODE_LONG_KEYS", 3)
    plans = []
    launch = A.paged_attention_cuda

    def record(q, k_pool, *a, **kw):
        long = kw.get("long", False)
        plans.append((long, A.attention_plan(q.shape[0], q.shape[1], k_pool.shape[2], q.shape[2], kw["n_keys"],
                                             long=long).get("qsh", False)))
        return launch(q, k_pool, *a, **kw)
    monkeypatch.setattr(A, "paged_attention_cuda", record)
    tree = tree_mask(np.array([-1, 0, 0, 1, 3]))
    depth = np.array([0, 1, 1, 2, 3])
    gpu = CUDABackend(use_graphs=False)
    wg, kg = build_weights(cfg, f, gpu.load_tensor), gpu.new_cache(cfg, 32)
    gpu.forward(fam, cfg, wg, kg, [3, 17], [0, 1], None, [1])
    kg.commit()
    gpu.forward(fam, cfg, wg, kg, [4], [2])  # over 2 keys: short (decode's kernels differ, so it is asked)
    kg.commit()
    runs = {}
    for shared in (True, False):
        monkeypatch.setattr(M, "Q_SHARED", shared)
        runs[shared] = gpu.forward(fam, cfg, wg, kg, [5, 6, 7, 8, 9], 3 + depth, tree)
        kg.commit([])
    # (long, Q in shared memory): the prefill, decode over 2 keys, the tree over 3 twice
    # (the backend asks once a width whether the long plan differs: still long, Q_SHARED off)
    assert plans == [(False, False), (False, False), (True, True), (True, False)], plans
    np.testing.assert_array_equal(runs[True], runs[False])


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_ffn_as_one_matmul(monkeypatch, act):
    """FUSED_GATED_MATMUL: at prefill widths the gated FFN (SwiGLU, and Gemma's GeGLU) is one
    matmul launch carrying W_up; off, two products and the activation. Both against the
    float64 references of the products (f16 inputs: 2^-8 of sum |w| |x| each, carried
    through the activation), and the launches counted."""
    import gguf
    from numba import cuda
    from luce.backends import cuda as C
    from luce.kernels import matmul as MM
    from luce.kernels.activation import gelu_tanh_ref, silu_ref
    from luce.kernels.dequant import dequantize
    from luce.kernels.matvec import matvec_ref
    from tests.test_dequant import random_tensor
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(21)
    n, k, n_ff = 5, 64, 32
    raw = [random_tensor(rng, Q.Q8_0, (n_ff, k)).reshape(n_ff, -1) for _ in range(2)]
    wg, wu = (C.DeviceWeight(cuda.to_device(r), Q.Q8_0, (n_ff, k)) for r in raw)
    x = (0.05 * rng.standard_normal((n, k))).astype(np.float32)
    g, u = (matvec_ref(r, Q.Q8_0, x) for r in raw)
    f = silu_ref if act == "silu" else gelu_tanh_ref
    bg, bu = (2.0 ** -8 * np.abs(x) @ np.abs(dequantize(r.reshape(-1), Q.Q8_0, (n_ff, k))).T + 1e-6 for r in raw)
    bound = 1.13 * bg * np.abs(u) + np.abs(f(g)) * bu + bg * bu
    calls, real = [], MM.matmul
    monkeypatch.setattr(MM, "matmul", lambda *a, **kw: calls.append(kw.get("w_up") is not None) or real(*a, **kw))
    for fused in (True, False):
        monkeypatch.setattr(C, "FUSED_GATED_MATMUL", fused)
        del calls[:]
        ops = C.CudaOps(C.CUDABackend(use_graphs=False), None)
        ops.arena = C.Arena(1 << 20)
        got = ops.gated_linear(cuda.to_device(x), wg, wu, act=act).copy_to_host()
        assert calls == ([True] if fused else [False, False]), calls
        assert np.all(np.abs(got - f(g) * u) <= bound), (fused, np.abs(got - f(g) * u).max())
