"""The persistent decode kernel in the simulator (one block: every phase's strided loops
covered by it) against the CPU backend on tiny random Qwen3s, three steps from an empty
cache: one with every weight type the kernel reads (its rows over float x: Q8_0 has no
int8-x unit), one with Q4_K and Q6_K only (its rows over x in int8)."""
import numpy as np
import pytest

from tests.ptx_background import assert_ptx_ok, background_ptx_check

# The real compiler's view at the Qwen3-0.6B shape, compiled in the background while the
# simulator tests run: it rejects what the simulator runs (a local array sized by an
# expression, not a constant, once), and the loads the kernel relies on must be there.
ptx_check = background_ptx_check("""
from luce.kernels.persistent_decode import compile_ptx_at
ptx = compile_ptx_at(1024, 16, 8, 128, 3072, 28)
assert ".maxntid 512" in ptx
assert "ld.global.cg.v4.u32" in ptx, "K/V rows in 16-byte loads from L2"
assert "ld.acquire.gpu.global.b32" in ptx and "red.release.gpu.global.add.s32" in ptx and "%globaltimer" in ptx
assert "ld.global.nc.L2::256B.v4.u32" in ptx or "ld.global.nc.v4.u32" in ptx, "16-byte weight loads"
assert "ld.v4.u32" in ptx and "dp4a" in ptx, "int8 x in 16-byte loads from shared memory, dp4a"
assert ".extern .shared" not in ptx and ".shared .align 16" in ptx, \
    "static arrays within 48 KB (x in int8 16-byte aligned): slices of a dynamic allocation spill more"
# a Qwen3-8B's shape: its shared memory (x staged for a 12,288-wide down) past 48 KB
from luce.kernels.persistent_decode import SMEM_OPTIN, _shared_bytes
assert 48 * 1024 < _shared_bytes(4096, 32, 8, 128, 12288, 512, True) <= SMEM_OPTIN
ptx = compile_ptx_at(4096, 32, 8, 128, 12288, 36, max_pages=130)
assert ".maxntid 512" in ptx and ".extern .shared .align 16" in ptx, "one dynamic allocation past 48 KB"
print("PTX OK")
""")


@pytest.fixture(scope="module", params=["float_x", "int8_x"])
def tiny_k_quants(tmp_path_factory, request):
    import gguf
    from tests.test_cuda_backend_sim import model_file
    Q = gguf.GGMLQuantizationType

    def types(n):
        if "norm" in n:
            return Q.F32
        if "attn_v" in n or "ffn_down" in n:
            return Q.Q6_K
        if "attn_output" in n and request.param == "float_x":
            return Q.Q8_0
        return Q.Q4_K
    f, fam, cfg = model_file(tmp_path_factory.mktemp("pd") / "tiny.gguf", "qwen3", types, seed=5, n_embd=256,
                             n_ff=256, n_heads=4, n_kv_heads=2, head_dim=64)
    return f, fam, cfg, request.param == "int8_x"


@pytest.fixture
def backends(tiny_k_quants, monkeypatch):
    """The CPU backend and the simulated CUDA backend with the kernel switched on, each with
    the model's weights and a fresh cache."""
    import luce.backends.cuda as cuda_backend
    from luce.backends.cpu import CPUBackend
    from luce.backends.cuda import CUDABackend
    from luce.models.transformer import build_weights
    monkeypatch.setattr(cuda_backend, "PERSISTENT_DECODE", True)
    f, fam, cfg, x8 = tiny_k_quants
    cpu, gpu = CPUBackend(), CUDABackend(use_graphs=False)
    return (x8, fam, cfg, cpu, gpu, build_weights(cfg, f, cpu.load_tensor), build_weights(cfg, f, gpu.load_tensor),
            cpu.new_cache(cfg, 128), gpu.new_cache(cfg, 128))


def _tolerance(x8, want):
    """f16 KV on the device; over int8 x (two planes, ~16 bits) the error the launch chain
    has too (its products take the same x: 1.7e-2 at logits up to 80 in this model, 2.2e-4
    of the largest), where the CPU backend's products take float x."""
    if x8:
        return {"rtol": 3e-3, "atol": 5e-4 * float(np.abs(want).max())}
    return {"rtol": 3e-3, "atol": 3e-3}


def test_persistent_decode_matches_cpu(backends):
    """Through the CUDA backend's one-token forward with the kernel switched on (the kernel
    then runs every step, the first included: its own K/V rows are the context)."""
    from luce.kernels.persistent_decode import applies
    x8, fam, cfg, cpu, gpu, w_cpu, w_gpu, kv_cpu, kv_gpu = backends
    assert applies(cfg, w_gpu, kv_gpu) is None
    assert {w_gpu.layers[0].wq.qtype.name, w_gpu.layers[0].wv.qtype.name, w_gpu.layers[0].wo.qtype.name} == \
        ({"Q4_K", "Q6_K"} if x8 else {"Q4_K", "Q6_K", "Q8_0"})
    pd = gpu._model_state(fam, cfg, w_gpu, kv_gpu)["persistent"]
    assert pd is not None and pd.x8 == x8
    pd.logits.copy_to_device(np.full((1, cfg.vocab_size), np.nan, np.float32))  # unwritten logits fail
    for p, t in enumerate([3, 17, 9]):
        want = cpu.forward(fam, cfg, w_cpu, kv_cpu, [t], [p])
        got = gpu.forward(fam, cfg, w_gpu, kv_gpu, [t], [p])
        kv_cpu.commit()
        kv_gpu.commit()
        np.testing.assert_allclose(got, want, **_tolerance(x8, want))
        assert int(np.argmax(got)) == int(np.argmax(want))
    # the K/V rows it stored are the CPU backend's, within f16's rounding
    for layer in range(cfg.n_layers):
        kg, vg, pg = kv_gpu.committed(layer)
        kc, vc, pc = kv_cpu.committed(layer)
        np.testing.assert_allclose(kg.astype(np.float32), kc.astype(np.float32), rtol=4e-3, atol=4e-3)
        np.testing.assert_allclose(vg.astype(np.float32), vc.astype(np.float32), rtol=4e-3, atol=4e-3)
        assert list(pg) == list(pc)
    # the grid barrier's counters are back at zero for the next launch
    assert not pd.cnt.copy_to_host().any()


def test_persistent_decode_over_two_passes_of_keys(backends):
    """70 keys (the CPU backend's, copied into the device pool) and the new one: in the
    simulator an attention pass scores 64 keys, so the online softmax carries across two
    passes and the value pass's batches run past the keys' end."""
    x8, fam, cfg, cpu, gpu, w_cpu, w_gpu, kv_cpu, kv_gpu = backends
    n = 70
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, n)
    cpu.forward(fam, cfg, w_cpu, kv_cpu, prompt, np.arange(n), None, [n - 1])
    kv_cpu.commit()
    kv_gpu.reserve(n)
    for layer in range(cfg.n_layers):
        k, v, pos = kv_cpu.committed(layer)
        kv_gpu.write(layer, k, v, pos)
    kv_gpu.commit()
    want = cpu.forward(fam, cfg, w_cpu, kv_cpu, [11], [n])
    got = gpu.forward(fam, cfg, w_gpu, kv_gpu, [11], [n])
    pd = gpu._model_state(fam, cfg, w_gpu, kv_gpu)["persistent"]
    assert pd is not None
    np.testing.assert_allclose(got, want, **_tolerance(x8, want))
    assert int(np.argmax(got)) == int(np.argmax(want))
    # a page an item: attention in two splits (one block takes every item here), merged in
    # o's staging; dropping a split fails it. Another summation order than one split:
    # within the GPU's arithmetic of the default.
    from numba import cuda

    from luce.kernels.persistent_decode import PersistentDecode
    tok, pos = cuda.to_device(np.array([11], np.int32)), cuda.to_device(np.array([n], np.int32))
    alt = PersistentDecode(cfg, w_gpu, kv_gpu, packed=pd.pk, pages_an_item=1)
    split = alt.forward(tok, pos).copy_to_host().reshape(got.shape)
    np.testing.assert_allclose(split, got, rtol=0, atol=1e-4 * float(np.abs(got).max()))
    np.testing.assert_allclose(split, want, **_tolerance(x8, want))
    assert not alt.cnt.copy_to_host().any()
    # a draft stopped on the device (its chain's stop set by the step before): the step
    # writes neither logits nor its K/V row, and leaves the barrier's counters at zero
    from luce.kernels.sampling import CHAIN_STOPPED, chain_state
    stopped = chain_state()
    stopped[0, CHAIN_STOPPED] = 1.0
    alt.logits.copy_to_device(np.full(alt.logits.shape, np.nan, np.float32))
    pools = kv_gpu.k_pool.copy_to_host(), kv_gpu.v_pool.copy_to_host()
    alt.forward(cuda.to_device(np.array([5], np.int32)), pos, cuda.to_device(stopped))
    assert np.isnan(alt.logits.copy_to_host()).all() and not alt.cnt.copy_to_host().any()
    np.testing.assert_array_equal(kv_gpu.k_pool.copy_to_host(), pools[0])
    np.testing.assert_array_equal(kv_gpu.v_pool.copy_to_host(), pools[1])


def test_persistent_decode_compiles_for_sm_90(ptx_check):
    assert_ptx_ok(ptx_check)


def test_persistent_decode_switch(tiny_k_quants, monkeypatch):
    """LUCE_PERSISTENT_DECODE unset: on where the GPU is real, off in the simulator (where it
    would run every test's one-token steps one block at a time); 0 and 1 force it."""
    import luce.backends.cuda as cuda_backend
    from luce.backends.cuda import CUDABackend
    from luce.models.transformer import build_weights
    f, fam, cfg, _ = tiny_k_quants
    gpu = CUDABackend(use_graphs=False)
    w = build_weights(cfg, f, gpu.load_tensor)
    for setting, on in ((None, False), (False, False), (True, True)):
        monkeypatch.setattr(cuda_backend, "PERSISTENT_DECODE", setting)
        assert (gpu._model_state(fam, cfg, w, gpu.new_cache(cfg, 128))["persistent"] is not None) == on, setting
    monkeypatch.setattr(cuda_backend, "PERSISTENT_DECODE", None)
    monkeypatch.setattr(gpu.cuda.config, "ENABLE_CUDASIM", False)  # what a real GPU reports
    assert gpu._persistent_decode(cfg, w, gpu.new_cache(cfg, 128)) is not None
    # by default only for a draft's size of weights; 1 takes a larger model too
    monkeypatch.setattr(cuda_backend, "PERSISTENT_DEFAULT_BYTES", 1000)
    assert gpu._persistent_decode(cfg, w, gpu.new_cache(cfg, 128)) is None
    monkeypatch.setattr(cuda_backend, "PERSISTENT_DECODE", True)
    assert gpu._persistent_decode(cfg, w, gpu.new_cache(cfg, 128)) is not None
