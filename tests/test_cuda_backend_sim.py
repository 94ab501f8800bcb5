"""The CUDA backend's wiring (weights, arena, paged KV, kernels) in numba's simulator,
against the CPU backend on a tiny random model: prefill, decode and a tree."""
import numpy as np
import pytest

from luce.kernels.attention import tree_mask


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_model(request, tmp_path_factory):
    return _tiny(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return _tiny("llama", tmp_path_factory)


def _tiny(arch, tmp_path_factory):
    import gguf
    Q = gguf.GGMLQuantizationType
    # qwen3 keeps F16 for two weights: the F16 products are the simulator's slowest (~2 s a call)
    types = (lambda n: Q.F32 if "norm" in n else Q.Q8_0) if arch == "llama" else \
        (lambda n: Q.F32 if "norm" in n else Q.F16 if "attn_v" in n or "ffn_down" in n else Q.Q8_0)
    return model_file(tmp_path_factory.mktemp(arch) / "tiny.gguf", arch, types, seed=3)


def model_file(path, arch, types, seed, **dims):
    """A tiny random model of `arch` written to path (one layer, 64 wide, unless dims say
    otherwise; `types`: a tensor name's type, or one type for every matrix): (GGUFFile,
    family, config)."""
    import gguf
    from luce.bench.synthetic import tiny, write_gguf
    from luce.gguf_file import GGUFFile
    from luce.plugins import family_for
    if not callable(types):
        qtype = types
        types = lambda n: gguf.GGMLQuantizationType.F32 if "norm" in n or n.endswith(".bias") else qtype  # noqa: E731
    shape = tiny(arch, 64, **(dict(n_layers=1, n_embd=64, n_ff=64, n_heads=2, n_kv_heads=1, head_dim=32) | dims))
    write_gguf(path, shape, types=types, seed=seed)
    f = GGUFFile(path)
    fam = family_for(path, f.architecture)
    return f, fam, fam.read_config(f)


def test_cuda_backend_matches_cpu_in_simulator(tiny_model):
    from luce.backends.cpu import CPUBackend
    from luce.backends.cuda import CUDABackend
    from luce.models.transformer import build_weights
    f, fam, cfg = tiny_model
    cpu, gpu = CPUBackend(), CUDABackend(use_graphs=False)
    w_cpu = build_weights(cfg, f, cpu.load_tensor)
    w_gpu = build_weights(cfg, f, gpu.load_tensor)
    kv_cpu, kv_gpu = cpu.new_cache(cfg, 64), gpu.new_cache(cfg, 64)
    prompt = [3, 17, 42]

    def both(tokens, positions, mask=None, rows=None, accept=None):
        a = cpu.forward(fam, cfg, w_cpu, kv_cpu, tokens, positions, mask, rows)
        b = gpu.forward(fam, cfg, w_gpu, kv_gpu, tokens, positions, mask, rows)
        kv_cpu.commit(accept)
        kv_gpu.commit(accept)
        np.testing.assert_allclose(b, a, rtol=2e-3, atol=2e-3)  # f16 KV on the device
        return a

    both(prompt, np.arange(3), rows=[2])
    both([9], [3])
    parents = np.array([-1, 0, -1])
    both([5, 6, 7], 4 + np.array([0, 1, 0]), mask=tree_mask(parents), accept=[2])
    both([12, 13], [5, 6])  # a 2-token chain after the tree's commit: the fast matvec with two x rows
    assert kv_gpu.n_past == kv_cpu.n_past == 7


@pytest.mark.parametrize("fused_write", [False, True], ids=["write_kv", "fused-write"])
def test_profile_forward_covers_every_op(tiny_llama, monkeypatch, fused_write):
    """luce bench's per-op breakdown records each kernel-launching op of a decode forward
    once per call site, labels projections by weight type and shape, and leaves the cache
    as it was; with the fused K/V write too (each op replayed alone in the layer it was
    recorded in)."""
    from luce.backends import cuda as C
    from luce.backends.cuda import CUDABackend
    monkeypatch.setattr(C, "FUSED_KV_WRITE", fused_write)
    from luce.bench.profile import profile_forward
    from luce.models.transformer import build_weights
    f, fam, cfg = tiny_llama
    gpu = CUDABackend(use_graphs=False)
    w = build_weights(cfg, f, gpu.load_tensor)
    kv = gpu.new_cache(cfg, 64)
    gpu.forward(fam, cfg, w, kv, [3], [0])
    kv.commit()
    before = gpu.forward(fam, cfg, w, kv, [9], [1])
    kv.commit([])
    prof = profile_forward(gpu, fam, cfg, w, kv, reps=1)
    assert kv.n_past == 1
    calls = {}
    for r in prof["rows"]:
        op = r["op"].split()[0]
        calls[op] = calls.get(op, 0) + r["calls"]
        assert r["us per forward"] > 0
    L = cfg.n_layers
    # o and down with the norm after each (linear_norm), the head; one rms_norm of its own
    # (the first layer's): q/k norms are in qk_rope
    assert calls["linear"] == 1 and calls["linear_norm"] == 2 * L and calls["linears"] == L
    assert calls["gated_linear"] == L and calls["attention"] == L
    assert calls["embed"] == 1 and calls["qk_rope"] == L and calls["rms_norm"] == 1
    labels = [r["op"] for r in prof["rows"]]
    assert any(lab.startswith("linear ") and "x" in lab for lab in labels), labels
    # the decode step itself is unchanged by the profiling runs
    np.testing.assert_allclose(gpu.forward(fam, cfg, w, kv, [9], [1]), before, rtol=1e-5, atol=1e-5)


def test_device_state_dies_with_its_cache(tiny_llama):
    """The backend's per-(weights, cache) state (arena, recorded graphs pointing at the
    cache's pools) goes when the cache goes: a new cache can reuse a dead one's id(), and
    must not inherit graphs that read freed memory."""
    import gc

    from luce.backends.cuda import CUDABackend
    from luce.models.transformer import build_weights
    f, fam, cfg = tiny_llama
    gpu = CUDABackend(use_graphs=False)
    w = build_weights(cfg, f, gpu.load_tensor)
    kv = gpu.new_cache(cfg, 64)
    gpu.forward(fam, cfg, w, kv, [3], [0])
    keep = gpu.new_cache(cfg, 64)
    gpu.forward(fam, cfg, w, keep, [3], [0])
    assert len(gpu._state) == 2
    del kv
    gc.collect()
    assert list(gpu._state) == [(id(w), id(keep))]


def test_failed_graph_capture_runs_eagerly(tiny_llama, monkeypatch):
    """A forward whose CUDA graph cannot be recorded (the simulator has none; here the
    recorder fails on purpose) runs eagerly with the same result, once warned, and is not
    tried again."""
    import warnings

    from luce.backends import cuda_graph
    from luce.backends.cuda import CUDABackend
    from luce.models.transformer import build_weights
    f, fam, cfg = tiny_llama
    gpu = CUDABackend(use_graphs=False)
    w = build_weights(cfg, f, gpu.load_tensor)
    kv = gpu.new_cache(cfg, 64)
    want = gpu.forward(fam, cfg, w, kv, [3], [0])  # eager: compiles, the form is now known
    tries = []

    class Refused:
        def __init__(self, stream, fn):
            tries.append(1)
            raise RuntimeError("capture refused")
    monkeypatch.setattr(cuda_graph, "Graph", Refused)
    gpu.use_graphs = True  # as on a GPU
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = gpu.forward(fam, cfg, w, kv, [3], [0])
        again = gpu.forward(fam, cfg, w, kv, [3], [0])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(again, want, rtol=1e-6)
    assert len(tries) == 1 and sum("eagerly" in str(c.message) for c in caught) == 1


def test_forward_counts_say_how_each_forward_ran(tiny_llama, monkeypatch):
    """forward_counts (what the spec bench reports over its timed runs): a form's first
    forward runs eagerly (it compiles), the next is recorded as a graph, later ones replay
    it, each with the eager result (a stand-in recorder that runs the forward when
    replayed: the simulator has no graphs); a refused recording runs eagerly."""
    from luce.backends import cuda_graph
    from luce.backends.cuda import CUDABackend
    from luce.models.transformer import build_weights

    class Recorder:
        def __init__(self, stream, fn):
            self.fn = fn

        def replay(self):
            self.fn()
    monkeypatch.setattr(cuda_graph, "Graph", Recorder)
    f, fam, cfg = tiny_llama
    gpu = CUDABackend(use_graphs=False)
    gpu.use_graphs = True  # as on a GPU
    w = build_weights(cfg, f, gpu.load_tensor)
    kv = gpu.new_cache(cfg, 64)
    seen = []
    for _ in range(3):
        seen.append(gpu.forward(fam, cfg, w, kv, [3, 5], [0, 1]))
        kv.commit([])
        seen.append(dict(gpu.forward_counts))
    assert seen[1::2] == [{"replayed": 0, "captured": 0, "eager": 1}, {"replayed": 0, "captured": 1, "eager": 1},
                          {"replayed": 1, "captured": 1, "eager": 1}]
    for got in seen[2::2]:
        np.testing.assert_allclose(got, seen[0], rtol=1e-6)
    monkeypatch.setattr(cuda_graph, "Graph", lambda *a: (_ for _ in ()).throw(RuntimeError("refused")))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpu.forward(fam, cfg, w, kv, [3], [0])  # a new width: eager, then its recording refused
        kv.commit([])
        gpu.forward(fam, cfg, w, kv, [3], [0])
    assert gpu.forward_counts == {"replayed": 1, "captured": 1, "eager": 3}


def test_matvec_mma_routing(monkeypatch):
    """With the tensor-core small-M product routed for 1-8 tokens (luce.backends.cuda.
    MATVEC_MMA_ROWS; 2-32 by default), the backend's linear (Q4_K with a bias; Q6_K adding into
    the residual stream in place) and gated FFN ops of a 3-token forward go through it and
    match the float64 references; a Q8_0 weight and a 9-token forward do not. x's conversion
    for a weight type is made once and kept while it is x's; an RMSNorm makes both. Two
    weights of one type and width in linears run as one launch."""
    import gguf
    from numba import cuda
    from luce.backends import cuda as C
    from luce.kernels import matvec_mma as M
    from luce.kernels.matvec import matvec_ref, swiglu_ref
    from tests.test_dequant import random_tensor
    Q = gguf.GGMLQuantizationType
    monkeypatch.setattr(C, "MATVEC_MMA_ROWS", range(1, 9))
    calls, real = [], M.matvec_mma
    monkeypatch.setattr(M, "matvec_mma", lambda *a, **k: calls.append(a[1].name) or real(*a, **k))
    rng = np.random.default_rng(11)
    ops = C.CudaOps(C.CUDABackend(use_graphs=False), None)
    ops.arena = C.Arena(1 << 20)

    def weight(qt, n, k=256):
        raw = random_tensor(rng, qt, (n, k)).reshape(n, -1)
        return raw, C.DeviceWeight(cuda.to_device(raw), qt, (n, k))

    from luce.kernels.dequant import dequantize

    def close(got, want, raw, qt, xx, scale=1.0):  # the kernel's f16 inputs: 2^-9 of sum |w| |x|
        bound = np.abs(xx) @ np.abs(dequantize(raw.reshape(-1), qt, (raw.shape[0], xx.shape[1]))).T
        assert np.all(np.abs(got - want) <= 2.0 ** -9 * scale * bound + 1e-5)

    x = rng.standard_normal((3, 256)).astype(np.float32)
    xd = cuda.to_device(x)
    raw4, w4 = weight(Q.Q4_K, 24)
    bias = rng.standard_normal(24).astype(np.float32)
    got = ops.linear(xd, w4, bias=cuda.to_device(bias)).copy_to_host()
    close(got, matvec_ref(raw4, Q.Q4_K, x, bias=bias), raw4, Q.Q4_K, x)
    raw6, w6 = weight(Q.Q6_K, 16)  # 16 rows: a 256-row product takes ~18 s in the simulator
    res = rng.standard_normal((3, 16)).astype(np.float32)
    rd = cuda.to_device(res)
    ops.linear(xd, w6, residual=rd)  # in place
    close(rd.copy_to_host(), matvec_ref(raw6, Q.Q6_K, x, residual=res), raw6, Q.Q6_K, x)
    (rg, wg), (ru, wu) = weight(Q.Q4_K, 16), weight(Q.Q4_K, 16)
    xs = x * 1e-3  # the random blocks' scales are large: keep the gate inside exp's range
    got = ops.gated_linear(cuda.to_device(xs), wg, wu).copy_to_host()
    # one gated launch: silu(g) u moves by at most ~1.1 |u| dg + |g| du
    g, u = matvec_ref(rg, Q.Q4_K, xs), matvec_ref(ru, Q.Q4_K, xs)
    close(got, swiglu_ref(rg, ru, Q.Q4_K, xs), rg, Q.Q4_K, xs, scale=1.1 * np.abs(u).max() + np.abs(g).max())
    assert calls == ["Q4_K", "Q6_K", "Q4_K"], calls
    _, w8 = weight(Q.Q8_0, 16)
    ops.linear(xd, w8)
    ops.linear(cuda.to_device(np.ones((9, 256), np.float32)), w4)
    assert len(calls) == 3, calls
    # linears (q, k, v): one conversion of x per weight type, each product right
    (r4b, w4b), (r6b, w6b) = weight(Q.Q4_K, 16), weight(Q.Q6_K, 16)
    convs, real_frags = [], M.x_frags
    monkeypatch.setattr(M, "x_frags", lambda *a, **k: convs.append(a[1].name) or real_frags(*a, **k))
    got = ops.linears(xd, [w4, w4b, w6b], [cuda.to_device(bias), None, None])
    # Q6_K's conversion of xd is the one linear(xd, w6) made above, kept; Q4_K's was since
    # rewritten for the gated product's x, so it is made again
    assert convs == ["Q4_K"], convs
    for g, (raw, qt, b) in zip(got, [(raw4, Q.Q4_K, bias), (r4b, Q.Q4_K, None), (r6b, Q.Q6_K, None)]):
        close(g.copy_to_host(), matvec_ref(raw, qt, x, bias=b), raw, qt, x)
    # an RMSNorm of these widths makes both layouts' fragments in its own launch
    from luce.kernels.norm import rms_norm_ref
    wn_host = rng.uniform(0.5, 1.5, 256).astype(np.float32)
    wn = cuda.to_device(wn_host)
    wn.luce_absmax = float(wn_host.max())  # as load_tensor records it: the output is in f16's range
    convs.clear()
    h = ops.rms_norm(xd, wn, 1e-6)
    pairs, real_pair = [], M.matvec_mma_pair
    monkeypatch.setattr(M, "matvec_mma_pair", lambda *a, **k: pairs.append(
        (a[2].name, k["third"] and k["third"][1].name)) or real_pair(*a, **k))
    # two Q4_K weights of one width (q and k) in one launch; 16 + 24 rows end inside a block,
    # so the Q6_K one (v) runs alone; 16 + 16 rows end on one, and v joins their launch
    calls.clear()
    got16 = ops.linears(h, [w4b, w4b, w6b], [None, None, None])
    assert convs == [] and pairs == [("Q4_K", "Q6_K")] and calls == [], (convs, pairs, calls)
    h16 = rms_norm_ref(x, wn_host, 1e-6)
    close(got16[2].copy_to_host(), matvec_ref(r6b, Q.Q6_K, h16), r6b, Q.Q6_K, h16)
    pairs.clear()
    got = ops.linears(h, [w4b, w4, w6b], [None, None, None])
    assert convs == [] and pairs == [("Q4_K", None)] and calls == ["Q6_K"], (convs, pairs, calls)
    hh = rms_norm_ref(x, wn_host, 1e-6)
    np.testing.assert_allclose(h.copy_to_host(), hh, rtol=2e-6, atol=1e-6)
    for g, (raw, qt) in zip(got, [(r4b, Q.Q4_K), (raw4, Q.Q4_K), (r6b, Q.Q6_K)]):
        close(g.copy_to_host(), matvec_ref(raw, qt, hh), raw, qt, hh)
    # into a carried buffer (linear_norm's, read by the next layer), they outlive new_layer
    carried = cuda.device_array((3, 256), np.float32)
    ops._carry = [(carried, None, None)]
    ops.rms_norm(xd, wn, 1e-6, out=carried)
    ops.new_layer()
    got = ops.gated_linear(carried, wg, wu)
    assert convs == [], convs
    close(got.copy_to_host(), swiglu_ref(rg, ru, Q.Q4_K, hh), rg, Q.Q4_K, hh,
          scale=1.1 * np.abs(matvec_ref(ru, Q.Q4_K, hh)).max() + np.abs(matvec_ref(rg, Q.Q4_K, hh)).max())
    # written in place (a residual add), its conversions are made again
    ops.add(carried, carried)
    ops._frags_for(carried, Q.Q6_K)
    assert convs == ["Q6_K"], convs


def test_matvec_mma_rows_from_env(monkeypatch):
    from luce.backends.cuda import rows_from_env
    from luce.errors import LuceError
    monkeypatch.setenv("LUCE_X_ROWS", "3-32")
    assert rows_from_env("LUCE_X_ROWS", range(0)) == range(3, 33)
    monkeypatch.setenv("LUCE_X_ROWS", "23")
    assert rows_from_env("LUCE_X_ROWS", range(0)) == range(23, 24)
    monkeypatch.delenv("LUCE_X_ROWS")
    assert rows_from_env("LUCE_X_ROWS", range(0)) == range(0)
    monkeypatch.setenv("LUCE_X_ROWS", "three")
    with pytest.raises(LuceError, match="LUCE_X_ROWS: expected"):
        rows_from_env("LUCE_X_ROWS", range(0))


def test_forward_greedy_returns_argmaxes_and_rows_on_demand(tiny_llama):
    """Greedy verification's forward (argmax of every row on the device, logits rows
    fetched when asked for), and its queued form, agree with forward on the same tree; a
    row of an earlier forward is refused once the device buffer has been reused."""
    from luce.backends.cuda import CUDABackend
    from luce.models.transformer import build_weights
    f, fam, cfg = tiny_llama
    gpu = CUDABackend(use_graphs=False)
    w = build_weights(cfg, f, gpu.load_tensor)
    kv = gpu.new_cache(cfg, 64)
    mask = tree_mask(np.array([-1, 0, 0, 1]))
    pos = mask.sum(1) - 1
    want = gpu.forward(fam, cfg, w, kv, [4, 7, 1, 8], pos, mask)
    kv.commit([])
    got = gpu.forward_greedy(fam, cfg, w, kv, [4, 7, 1, 8], pos, mask)
    assert list(got.ids) == list(want.argmax(1)) and len(got) == 4
    np.testing.assert_array_equal(got[2], want[2])
    kv.commit([])
    # queued: the same argmaxes once its result is read
    pending = gpu.queue_greedy(fam, cfg, w, kv, [4, 7, 1, 8], pos, mask)
    again = pending.result()
    assert list(again.ids) == list(got.ids)
    np.testing.assert_array_equal(again[3], want[3])
    kv.commit([])
    gpu.forward_greedy(fam, cfg, w, kv, [4], [0])
    with pytest.raises(RuntimeError, match="reused"):
        got[0]


def test_f16_guard_skipped_only_for_bounded_activations(monkeypatch):
    """The tensor-core products skip the f16 guard's fixup for an RMSNorm's output when
    sqrt(K) max|w| < 2**15 (load_tensor records max|w|: that norm makes the fragments
    itself, rms_norm_frags) and for attention's output over an f16 pool; any other x, and a
    norm with a larger weight, keep it."""
    import gguf
    from numba import cuda
    from luce.backends import cuda as C
    from luce.gguf_file import TensorInfo
    from luce.kernels import matvec_mma as M
    Q = gguf.GGMLQuantizationType
    monkeypatch.setattr(C, "MATVEC_MMA_ROWS", range(1, 9))
    guards, used = [], []  # each conversion's guard; the fragments each product took
    monkeypatch.setattr(M, "x_frags", lambda x, qt, stream=0, guard=True: guards.append(guard) or ("x_frags",))
    monkeypatch.setattr(M, "matvec_mma", lambda *a, **k: used.append(k["frags"][0]) or k["out"])
    be = C.CUDABackend(use_graphs=False)
    ops = C.CudaOps(be, None)
    ops.arena = C.Arena(1 << 20)

    def norm_weight(scale):
        data = np.full(256, scale, np.float32)
        return be.load_tensor(TensorInfo("n", Q.F32, (256,), data.nbytes, data.view(np.uint8)))

    w = C.DeviceWeight(cuda.to_device(np.zeros((16, 144), np.uint8)), Q.Q4_K, (16, 256))
    x = cuda.to_device(np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32))
    small, big = norm_weight(2.0), norm_weight(2100.0)  # sqrt(256) * 2100 = 33600 >= 0.99 * 2**15
    assert small.luce_absmax == 2.0
    ops.linear(ops.rms_norm(x, small, 1e-6), w)
    ops.linear(ops.rms_norm(x, big, 1e-6), w)
    ops.linear(x, w)
    ops.linear(ops.merge_heads(x.reshape((3, 2, 128))), w)
    heads = x.reshape((3, 2, 128))
    ops._in_range.append(heads)  # as attention marks its output over an f16 pool
    ops.linear(ops.merge_heads(heads), w)
    assert guards == [True, True, True, False]  # the small-weight norm's: no conversion
    assert not isinstance(used[0], str) and used[1:] == ["x_frags"] * 4
    ops.new_layer()
    h = ops.rms_norm(x, small, 1e-6)
    ops.new_layer()  # a layer's marks do not outlive it
    ops.linear(h, w)
    assert guards[-1] is True


def test_gemma3_numerics_in_simulator(tmp_path, monkeypatch):
    """Gemma 3's numerics on the device (embedding scale, the post-norms' residual steps,
    GeGLU, a sliding window shorter than the sequence) against the CPU backend; every
    forward's residual steps take one launch (rms_norm_cuda's pre_weight; the norm after each one
    read by the next layer's projections from the carried buffers), and a decode row's GeGLU
    FFN matvec_fast's gated launch."""
    import gguf
    from luce.backends.cpu import CPUBackend
    from luce.backends.cuda import CUDABackend
    from luce.kernels import norm
    from luce.models.transformer import build_weights
    from luce.kernels import matvec_fast
    launches, gated = [], []
    plain = norm.rms_norm_cuda
    monkeypatch.setattr(norm, "rms_norm_cuda", lambda *a, **k: (k.get("pre_weight") is not None and
                                                                launches.append(a[0].shape)) or plain(*a, **k))
    fast = matvec_fast.swiglu_fast
    monkeypatch.setattr(matvec_fast, "swiglu_fast", lambda *a, **k: gated.append(k.get("act")) or fast(*a, **k))
    f, fam, cfg = model_file(tmp_path / "gemma3.gguf", "gemma3", gguf.GGMLQuantizationType.Q8_0, seed=4,
                             sliding_window=4)
    assert fam.name == "gemma3" and cfg.layer_window(0) == 4 and cfg.ffn_act == "gelu_tanh"
    cpu, gpu = CPUBackend(), CUDABackend(use_graphs=False)
    w_cpu, w_gpu = build_weights(cfg, f, cpu.load_tensor), build_weights(cfg, f, gpu.load_tensor)
    kv_cpu, kv_gpu = cpu.new_cache(cfg, 16), gpu.new_cache(cfg, 16)
    for tokens, positions, rows in [([3, 17, 42, 8, 9, 30], np.arange(6), [5]), ([11], [6], None), ([12], [7], None)]:
        a = cpu.forward(fam, cfg, w_cpu, kv_cpu, tokens, positions, None, rows)
        b = gpu.forward(fam, cfg, w_gpu, kv_gpu, tokens, positions, None, rows)
        kv_cpu.commit()
        kv_gpu.commit()
        np.testing.assert_allclose(b, a, rtol=2e-3, atol=2e-3)  # f16 KV on the device
        assert launches == [(len(tokens), cfg.n_embd)] * (2 * cfg.n_layers)
        # decode rows: the GeGLU FFN as one gated launch a layer
        assert gated == (["gelu_tanh"] * cfg.n_layers if len(tokens) == 1 else [])
        launches.clear()
        gated.clear()


def test_gated_output_fragments_feed_the_down_projection(monkeypatch):
    """On matvec_mma's widths the gated FFN's launch writes its output's fragments
    (frags_out), and the down projection runs only the f16 guard's fixup on them, not a
    conversion; LUCE_GATED_FRAGS=0 (GATED_FRAGS) goes back to converting."""
    import gguf
    from numba import cuda
    from luce.backends import cuda as C
    from luce.kernels import matvec_mma as M
    Q = gguf.GGMLQuantizationType
    monkeypatch.setattr(C, "MATVEC_MMA_ROWS", range(1, 9))
    calls = []
    monkeypatch.setattr(M, "x_frags", lambda x, qt, stream=0, guard=True: calls.append(("x_frags", qt.name)) or
                        ("converted", None))
    monkeypatch.setattr(M, "frags_fixup", lambda x, qt, stream=0, gated_out=False: calls.append(
        ("fixup", qt.name, gated_out)) or ("fixed", None))
    monkeypatch.setattr(M, "matvec_mma", lambda *a, **k: calls.append(("mma", k.get("frags_out", False),
                                                                       k["frags"][0])) or k["out"])
    ops = C.CudaOps(C.CUDABackend(use_graphs=False), None)
    ops.arena = C.Arena(1 << 22)
    gate = C.DeviceWeight(cuda.to_device(np.zeros((512, 144), np.uint8)), Q.Q4_K, (512, 256))
    down = C.DeviceWeight(cuda.to_device(np.zeros((256, 420), np.uint8)), Q.Q6_K, (256, 512))
    x = cuda.to_device(np.ones((3, 256), np.float32))
    for on, want in [(True, [("x_frags", "Q4_K"), ("mma", True, "converted"), ("fixup", "Q6_K", True),
                             ("mma", False, "fixed")]),
                     (False, [("x_frags", "Q4_K"), ("mma", False, "converted"), ("x_frags", "Q6_K"),
                              ("mma", False, "converted")])]:
        monkeypatch.setattr(C, "GATED_FRAGS", on)
        calls.clear()
        ops.new_layer()
        ops._frags = {}
        ops.linear(ops.gated_linear(x, gate, gate), down)
        assert calls == want, (on, calls)


def test_linear_norm_leaves_the_norm_to_the_products_that_read_it(monkeypatch):
    """With LUCE_MMA_NORM=1 (MMA_NORM, off by default: measured slower), linear_norm on
    matvec_mma's widths is one matvec_mma_norm launch: the gated FFN and linears read its
    fragments with no conversion or norm launch, another reader (a part of the rows) gets
    the norm made from the residual stream into the carried buffer; off, the product and
    rms_norm_frags."""
    import gguf
    from numba import cuda
    from luce.backends import cuda as C
    from luce.kernels import matvec_mma as M
    Q = gguf.GGMLQuantizationType
    monkeypatch.setattr(C, "MATVEC_MMA_ROWS", range(1, 9))
    calls = []
    monkeypatch.setattr(M, "x_frags", lambda x, qt, stream=0, guard=True: calls.append(("x_frags", qt.name)) or
                        ("converted", None))
    monkeypatch.setattr(M, "matvec_mma_norm", lambda w, qt, x, res, nw, eps, stream=0, frags=None, layout=None:
                        calls.append(("mma_norm", frags[0])) or {Q.Q4_K: ("norm4", "inv"), Q.Q6_K: ("norm6", "inv")})
    monkeypatch.setattr(M, "rms_norm_frags", lambda x, w, eps, h, stream=0: calls.append(("norm_frags",)) or
                        {Q.Q4_K: ("rn4", None), Q.Q6_K: ("rn6", None)})
    monkeypatch.setattr(M, "matvec_mma", lambda *a, **k: calls.append(("mma", k["frags"][0])) or k["out"])
    monkeypatch.setattr(M, "matvec_mma_pair", lambda *a, **k: calls.append(("pair", k["frags"][0])) or (a[6], a[7]))
    ops = C.CudaOps(C.CUDABackend(use_graphs=False), None)
    ops.arena = C.Arena(1 << 22)
    h_buf = cuda.device_array((3, 256), np.float32)
    ops._carry = [(h_buf, None, None), (h_buf, None, None)]
    wo = C.DeviceWeight(cuda.to_device(np.zeros((256, 144), np.uint8)), Q.Q4_K, (256, 256))
    gate = C.DeviceWeight(cuda.to_device(np.zeros((512, 144), np.uint8)), Q.Q4_K, (512, 256))
    norm_w = cuda.to_device(np.ones(256, np.float32))
    norm_w.luce_absmax = 1.0
    x = cuda.to_device(np.ones((3, 256), np.float32))
    res = cuda.to_device(np.ones((3, 256), np.float32))
    for on in (False, True):  # on last: its check replaces rms_norm for the rest of the test
        monkeypatch.setattr(C, "MMA_NORM", on)
        calls.clear()
        ops.new_layer()
        ops._frags = {}
        res_out, h = ops.linear_norm(x, wo, res, norm_w, 1e-6)
        assert res_out is res
        ops.linears(h, [wo, wo], [None, None])  # q and k (the next layer's, after down)
        ops.gated_linear(h, gate, gate)  # or the FFN (after o)
        if on:
            assert isinstance(h, C.MmaNorm)
            assert calls == [("x_frags", "Q4_K"), ("mma_norm", "converted"), ("pair", "norm4"), ("mma", "norm4")], \
                calls
            # a reader of rows 1..2 only: the norm is made, into the carried buffer
            made = []
            monkeypatch.setattr(ops, "rms_norm", lambda xx, w, eps, out=None, xq=None: made.append((xx, out)) or out)
            assert ops.take_rows(h, [1, 2]) is not None and made == [(res, h_buf)]
        else:
            assert calls == [("x_frags", "Q4_K"), ("mma", "converted"), ("norm_frags",), ("pair", "rn4"),
                             ("mma", "rn4")], calls


def test_profile_forward_of_a_tree_runs_its_attention_with_the_mask(tiny_llama, monkeypatch):
    """The bench's verification breakdown profiles the tree it verifies: every attention
    call of the recorded and replayed forwards gets the tree's mask bits (before, the
    profile ran a causal forward of as many tokens), and the cache is left as it was."""
    from luce.backends.cuda import CUDABackend
    from luce.bench.e2e import two_chains
    from luce.bench.profile import profile_forward
    from luce.kernels import attention as A
    from luce.models.transformer import build_weights
    seen = []
    real = A.paged_attention_cuda

    def spy(*args, **kwargs):
        seen.append(args[8])  # mask_bits
        return real(*args, **kwargs)
    monkeypatch.setattr(A, "paged_attention_cuda", spy)
    f, fam, cfg = tiny_llama
    gpu = CUDABackend(use_graphs=False)
    w = build_weights(cfg, f, gpu.load_tensor)
    kv = gpu.new_cache(cfg, 64)
    gpu.forward(fam, cfg, w, kv, [3, 4], [0, 1])
    kv.commit()
    with pytest.raises(ValueError, match="mask of 3 x 3"):
        profile_forward(gpu, fam, cfg, w, kv, n_tokens=3, reps=1, mask=two_chains(4))
    kv.commit([])
    seen.clear()
    profile_forward(gpu, fam, cfg, w, kv, n_tokens=3, reps=1, mask=two_chains(3))
    assert kv.n_past == 2 and len(seen) >= 2 * cfg.n_layers and all(m is not None for m in seen)


def test_q6_k_groups_copy_feeds_the_verification_products(monkeypatch):
    """LUCE_Q6K_G8: a planned Q6_K down projection of 2,048 columns gets a copy in
    q6k_groups' layout at load; a verification width's product (matvec_mma) reads that copy
    and gives the GGUF layout's bits (the same sums in the same order); decode's one row
    (matvec_fast) reads the GGUF copy."""
    import gguf
    from numba import cuda
    from luce.backends import cuda as C
    from luce.gguf_file import TensorInfo
    from luce.kernels import matvec_fast as F
    from luce.kernels import matvec_mma as M
    from test_matvec import weights
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(5)
    n_out, k = 16, 2048
    raw = weights(rng, Q.Q6_K, n_out, k).reshape(-1)
    info = TensorInfo("blk.0.ffn_down.weight", Q.Q6_K, (n_out, k), raw.nbytes, raw)
    seen = []
    real_fast, real_mma = F._launch, M._launch
    monkeypatch.setattr(F, "_launch", lambda *a, **kw: seen.append(("fast", kw.get("layout"))) or real_fast(*a, **kw))
    monkeypatch.setattr(M, "_launch", lambda *a, **kw: seen.append(("mma", kw.get("g8"))) or real_mma(*a, **kw))
    x = cuda.to_device(rng.standard_normal((2, k)).astype(np.float32))
    got = {}
    for setting in ("0", "1"):
        monkeypatch.setattr(C, "Q6K_G8", setting)
        be = C.CUDABackend(use_graphs=False)
        be.plan_weights({info.name: info}, False)
        w = be.load_tensor(info)
        assert (w.g8 is not None) == (setting == "1")
        ops = C.CudaOps(be, None)
        ops.arena = C.Arena(1 << 20)
        seen.clear()
        got[setting] = ops.linear(x, w).copy_to_host()
        assert seen == [("mma", setting == "1")], seen
        seen.clear()
        ops.linear(x[:1], w)
        assert seen == [("fast", None)], seen
    assert not np.isnan(got["1"]).any()
    np.testing.assert_array_equal(got["1"], got["0"])


def test_q6_k_groups_plan_copies_the_down_projections_and_head_where_they_fit():
    """g8_plan: under auto, the Q6_K down projections and the head (the embedding table
    when it is the head) get a copy only if the model, the copies and the reserve fit in
    free memory; 1 always, 0 never; other Q6_K tensors (attn_v, an untied embedding) and
    rows not of 2,048k columns never."""
    import gguf
    from luce.backends.cuda import g8_plan, g8_reserve
    from luce.gguf_file import TensorInfo
    Q = gguf.GGMLQuantizationType

    def t(name, qtype, rows, cols):
        return name, TensorInfo(name, qtype, (rows, cols), rows * cols // 256 * (210 if qtype == Q.Q6_K else 144), None)
    tensors = dict([t("blk.0.ffn_down.weight", Q.Q6_K, 4096, 12288), t("blk.1.ffn_down.weight", Q.Q6_K, 4096, 12288),
                    t("blk.0.attn_v.weight", Q.Q6_K, 1024, 4096), t("blk.0.ffn_up.weight", Q.Q4_K, 12288, 4096),
                    t("token_embd.weight", Q.Q6_K, 1000, 4096), t("output.weight", Q.Q6_K, 1000, 4096),
                    t("blk.2.ffn_down.weight", Q.Q6_K, 4096, 1280)])
    want = {"blk.0.ffn_down.weight", "blk.1.ffn_down.weight", "output.weight"}
    total = sum(v.n_bytes for v in tensors.values()) + sum(tensors[n].n_bytes for n in want)
    big = 80 << 30
    assert g8_plan(tensors, False, big, big, "auto") == want
    assert g8_plan(tensors, False, total + g8_reserve(big) - 1, big, "auto") == set()
    assert g8_plan(tensors, False, total + g8_reserve(big), big, "auto") == want
    assert g8_plan(tensors, False, 0, big, "1") == want
    assert g8_plan(tensors, False, big, big, "0") == set()
    tied = {n: v for n, v in tensors.items() if n != "output.weight"}
    assert g8_plan(tied, True, big, big, "auto") == want - {"output.weight"} | {"token_embd.weight"}
    assert g8_reserve(1 << 50) == (1 << 50) // 5 and g8_reserve(24 << 30) == 8 << 30
