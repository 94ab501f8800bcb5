"""The persistent decode kernel on the GPU, at a real grid (one block an SM, its grid
barriers live), through the CUDA backend's switch (so inside its captured graphs), against
the CPU backend: a random Q4_K_M-typed qwen3 with head_dim 128, a 100-token prompt prefilled
by the launch chain, then 40 one-token steps through the kernel (fed the CPU's greedy
tokens, so a near-tie cannot make the two diverge; the context crosses a 64-row page) and a
tree verification forward after them (the launch chain again, over the kernel's K/V rows).
Logits agree within the GPU's arithmetic (f16 KV, another summation order): relative L2
error per row below 2e-2.

Run with: NUMBA_ENABLE_CUDASIM=0 pytest -m gpu tests/gpu/test_persistent_decode_gpu.py (the
suite's conftest puts numba in its simulator otherwise, where these never finish)."""
import numpy as np
import pytest

from tests.gpu.test_cuda_backend_synthetic_gpu import _cpu_and_gpu, random_qwen3

pytestmark = pytest.mark.gpu


def test_persistent_decode_matches_cpu_on_gpu(tmp_path, monkeypatch):
    import luce.backends.cuda as cuda_backend
    from luce.kernels.attention import tree_mask
    monkeypatch.setattr(cuda_backend, "PERSISTENT_DECODE", True)
    f, fam, cfg = random_qwen3(tmp_path)
    both, (gpu, wg, kc, kg) = _cpu_and_gpu(fam, cfg, f, 512)
    prompt = np.random.default_rng(0).integers(0, 2048, 100)
    logits = both(prompt, np.arange(100), rows=[99])
    assert gpu._model_state(fam, cfg, wg, kg)["persistent"] is not None
    for i in range(40):
        logits = both([int(logits[-1].argmax())], [100 + i])
    n = kg.n_past
    parents = [-1, 0, 1, 0]  # a chain of three and a sibling of its second node
    both([5, 6, 7, 8], [n, n + 1, n + 2, n + 1], tree_mask(parents), accept=[0, 1])
    logits = both([9], [n + 2])
    assert not gpu._model_state(fam, cfg, wg, kg)["persistent"].cnt.copy_to_host().any()


def test_persistent_decode_splits_match_on_gpu(tmp_path):
    """Attention's splits at a real grid: over a 300-token context (five pages, two kv
    heads) the default spreads the items over the grid (a page an item: five splits a
    head, merged in o's staging); two pages an item (three splits) and five (one) must
    give the same logits within the GPU's arithmetic (the merge sums the splits in
    another order), ten steps each from the same state. Each kernel writes the step's K/V
    row again (the same values within that arithmetic)."""
    from numba import cuda

    from luce.backends.cuda import CUDABackend
    from luce.kernels.persistent_decode import PersistentDecode
    from luce.models.transformer import build_weights
    f, fam, cfg = random_qwen3(tmp_path)
    gpu = CUDABackend()
    w = build_weights(cfg, f, gpu.load_tensor)
    kv = gpu.new_cache(cfg, 512)
    n = 300
    gpu.forward(fam, cfg, w, kv, np.random.default_rng(2).integers(0, 2048, n), np.arange(n), None, [n - 1])
    kv.commit()
    base = PersistentDecode(cfg, w, kv)
    options = [{"pages_an_item": 2}, {"pages_an_item": 5}]
    kernels = [PersistentDecode(cfg, w, kv, packed=base.pk, **o) for o in options]
    for step in range(10):
        tok = cuda.to_device(np.array([(7 * step + 3) % 2048], np.int32))
        pos = cuda.to_device(np.array([n + step], np.int32))
        kv.reserve(1)
        want = base.forward(tok, pos).copy_to_host()
        for o, k in zip(options, kernels):
            got = k.forward(tok, pos).copy_to_host()
            rel = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert rel < 2e-3, (o, step, rel)
            assert not k.cnt.copy_to_host().any(), o
        kv.commit()
