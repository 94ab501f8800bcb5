"""The persistent decode kernel in the simulator (one block: every phase's strided loops
covered by it) against the CPU backend on a tiny random Qwen3 with every weight type the
kernel reads; a prompt prefilled by the CUDA backend's own path, then decode steps."""
import numpy as np
import pytest


@pytest.fixture(scope="module")
def tiny_k_quants(tmp_path_factory):
    import gguf
    Q = gguf.GGMLQuantizationType
    from luce.bench.synthetic import tiny, write_gguf
    from luce.gguf_file import GGUFFile
    from luce.plugins import family_for

    def types(n):
        if "norm" in n:
            return Q.F32
        if "attn_v" in n or "ffn_down" in n:
            return Q.Q6_K
        if "attn_output" in n:
            return Q.Q8_0
        return Q.Q4_K
    path = tmp_path_factory.mktemp("pd") / "tiny.gguf"
    shape = tiny("qwen3", 32, n_layers=1, n_embd=256, n_ff=256, n_heads=4, n_kv_heads=2, head_dim=64)
    write_gguf(path, shape, types=types, seed=5)
    f = GGUFFile(path)
    fam = family_for(path, f.architecture)
    return f, fam, fam.read_config(f)


def test_persistent_decode_matches_cpu(tiny_k_quants):
    from luce.backends.cpu import CPUBackend
    from luce.backends.cuda import CUDABackend
    from luce.kernels.persistent_decode import PersistentDecode, applies
    from luce.models.transformer import build_weights
    from numba import cuda
    f, fam, cfg = tiny_k_quants
    cpu, gpu = CPUBackend(), CUDABackend(use_graphs=False)
    w_cpu = build_weights(cfg, f, cpu.load_tensor)
    w_gpu = build_weights(cfg, f, gpu.load_tensor)
    kv_cpu, kv_gpu = cpu.new_cache(cfg, 128), gpu.new_cache(cfg, 128)
    assert applies(cfg, w_gpu, kv_gpu) is None
    assert {w_gpu.layers[0].wq.qtype.name, w_gpu.layers[0].wv.qtype.name, w_gpu.layers[0].wo.qtype.name} == \
        {"Q4_K", "Q6_K", "Q8_0"}
    prompt = [3, 17, 22, 5]
    cpu.forward(fam, cfg, w_cpu, kv_cpu, prompt, np.arange(4), None, [3])
    gpu.forward(fam, cfg, w_gpu, kv_gpu, prompt, np.arange(4), None, [3])
    kv_cpu.commit()
    kv_gpu.commit()
    pd = PersistentDecode(cfg, w_gpu, kv_gpu)
    tok_d, pos_d = cuda.to_device(np.zeros(1, np.int32)), cuda.to_device(np.zeros(1, np.int32))
    pd.logits.copy_to_device(np.full((1, cfg.vocab_size), np.nan, np.float32))  # unwritten logits fail
    for step, t in enumerate([9]):
        p = 4 + step
        want = cpu.forward(fam, cfg, w_cpu, kv_cpu, [t], [p])
        kv_cpu.commit()
        kv_gpu.reserve(1)
        tok_d.copy_to_device(np.array([t], np.int32))
        pos_d.copy_to_device(np.array([p], np.int32))
        got = pd.forward(tok_d, pos_d).copy_to_host()
        kv_gpu.commit()
        np.testing.assert_allclose(got, want, rtol=3e-3, atol=3e-3)  # f16 KV on the device
        assert int(np.argmax(got)) == int(np.argmax(want))
    # the K/V rows it stored (after the prompt's) are the CPU backend's, within f16's rounding
    n = len(prompt)
    for layer in range(cfg.n_layers):
        kg, vg, pg = kv_gpu.committed(layer)
        kc, vc, pc = kv_cpu.committed(layer)
        np.testing.assert_allclose(kg[n:].astype(np.float32), kc[n:].astype(np.float32), rtol=4e-3, atol=4e-3)
        np.testing.assert_allclose(vg[n:].astype(np.float32), vc[n:].astype(np.float32), rtol=4e-3, atol=4e-3)
        assert list(pg) == list(pc)
    # the grid barrier's counters are back at zero for the next launch
    assert not pd.cnt.copy_to_host().any()
