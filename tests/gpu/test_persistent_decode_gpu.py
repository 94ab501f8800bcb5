"""The persistent decode kernel on the GPU, at a real grid (one block an SM, its grid
barriers live), through the CUDA backend's switch (so inside its captured graphs), against
the CPU backend: a random Q4_K_M-typed qwen3 with head_dim 128, a 100-token prompt prefilled
by the launch chain, then 40 one-token steps through the kernel (fed the CPU's greedy
tokens, so a near-tie cannot make the two diverge; the context crosses a 64-row page) and a
tree verification forward after them (the launch chain again, over the kernel's K/V rows).
Logits agree within the GPU's arithmetic (f16 KV, another summation order): relative L2
error per row below 2e-2."""
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
