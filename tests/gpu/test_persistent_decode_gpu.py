"""The persistent decode kernel on the GPU, at a real grid (one block an SM, its grid
barriers live), against the CPU backend: a random Q4_K_M-typed qwen3 with head_dim 128,
a 100-token prompt prefilled by the CUDA backend, then 40 decode steps through the kernel
(fed the CPU's greedy tokens, so a near-tie cannot make the two diverge; the context
crosses a 64-row page). Logits agree within the GPU's arithmetic (f16 KV, another
summation order): relative L2 error per row below 2e-2."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_persistent_decode_matches_cpu_on_gpu(tmp_path):
    from numba import cuda

    from luce.backends.cpu import CPUBackend
    from luce.backends.cuda import CUDABackend
    from luce.bench.synthetic import tiny, write_gguf
    from luce.gguf_file import GGUFFile
    from luce.kernels.persistent_decode import PersistentDecode
    from luce.models.transformer import build_weights
    from luce.plugins import family_for
    shape = tiny("qwen3", 2048, n_layers=2, n_embd=512, n_ff=1024, n_heads=8, n_kv_heads=2, head_dim=128)
    path = write_gguf(tmp_path / "q3.gguf", shape, seed=5)
    f = GGUFFile(path)
    fam = family_for(path, f.architecture)
    cfg = fam.read_config(f)
    cpu, gpu = CPUBackend(), CUDABackend()
    wc, wg = build_weights(cfg, f, cpu.load_tensor), build_weights(cfg, f, gpu.load_tensor)
    kc, kg = cpu.new_cache(cfg, 512), gpu.new_cache(cfg, 512)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 2048, 100)
    logits = cpu.forward(fam, cfg, wc, kc, prompt, np.arange(100), None, [99])
    gpu.forward(fam, cfg, wg, kg, prompt, np.arange(100), None, [99])
    kc.commit()
    kg.commit()
    pd = PersistentDecode(cfg, wg, kg, stream=gpu.stream)
    tok_d, pos_d = cuda.to_device(np.zeros(1, np.int32)), cuda.to_device(np.zeros(1, np.int32))
    for i in range(40):
        t = int(logits[-1].argmax())
        logits = cpu.forward(fam, cfg, wc, kc, [t], [100 + i])
        kc.commit()
        kg.reserve(1)
        tok_d.copy_to_device(np.array([t], np.int32), stream=gpu.stream)
        pos_d.copy_to_device(np.array([100 + i], np.int32), stream=gpu.stream)
        got = pd.forward(tok_d, pos_d).copy_to_host(stream=gpu.stream)
        gpu.stream.synchronize()
        kg.commit()
        rel = np.linalg.norm(got - logits, axis=-1) / np.linalg.norm(logits, axis=-1)
        assert rel.max() < 2e-2, (i, rel.max())
    assert not pd.cnt.copy_to_host().any()
