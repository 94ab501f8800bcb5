"""The CUDA backend end to end on a random Q4_K_M-typed qwen3 (head_dim 128: the decode
attention kernel; 2+ rows: the small-M matmul) against the CPU backend: prefill, 40
graph-replayed decode steps (fed the CPU's greedy tokens, so a near-tie cannot make the
two diverge) and a verification tree (widths 2-32 take matvec_mma; its greedy form, with
the argmaxes taken in the graph, agrees with the logits). Logits agree within the GPU's arithmetic (f16 KV,
different summation order): relative L2 error per row below 2e-2."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _cpu_and_gpu(fam, cfg, f, n_ctx):
    """Both backends on the model in f; `both(tokens, positions, mask, rows, accept)` runs a
    forward on each, commits, checks the logits agree and returns the CPU's."""
    from luce.backends.cpu import CPUBackend
    from luce.backends.cuda import CUDABackend
    from luce.models.transformer import build_weights
    cpu, gpu = CPUBackend(), CUDABackend()
    wc, wg = build_weights(cfg, f, cpu.load_tensor), build_weights(cfg, f, gpu.load_tensor)
    kc, kg = cpu.new_cache(cfg, n_ctx), gpu.new_cache(cfg, n_ctx)

    def both(tokens, positions, mask=None, rows=None, accept=None):
        a = cpu.forward(fam, cfg, wc, kc, tokens, positions, mask, rows)
        b = gpu.forward(fam, cfg, wg, kg, tokens, positions, mask, rows)
        kc.commit(accept)
        kg.commit(accept)
        rel = np.linalg.norm(b - a, axis=-1) / np.linalg.norm(a, axis=-1)
        assert rel.max() < 2e-2, rel.max()
        return a
    return both, (gpu, wg, kc, kg)


def random_qwen3(tmp_path):
    """A random Q4_K_M-typed qwen3 (two layers, head_dim 128, a 2,048 vocabulary): (file,
    family, config)."""
    from luce.bench.synthetic import tiny, write_gguf
    from luce.gguf_file import GGUFFile
    from luce.plugins import family_for
    shape = tiny("qwen3", 2048, n_layers=2, n_embd=512, n_ff=1024, n_heads=8, n_kv_heads=2, head_dim=128)
    path = write_gguf(tmp_path / "q3.gguf", shape, seed=5)
    f = GGUFFile(path)
    fam = family_for(path, f.architecture)
    return f, fam, fam.read_config(f)


def test_random_qwen3_matches_cpu(tmp_path):
    from luce.kernels.attention import tree_mask
    f, fam, cfg = random_qwen3(tmp_path)
    both, (gpu, wg, kc, kg) = _cpu_and_gpu(fam, cfg, f, 512)

    rng = np.random.default_rng(0)
    logits = both(rng.integers(0, 2048, 100), np.arange(100), rows=[99])
    for i in range(40):
        logits = both([int(logits[-1].argmax())], [100 + i])
    n = kc.n_past
    parents = np.array([-1, 0, 0, 1, -1, 4])
    mask = tree_mask(parents)
    toks = rng.integers(0, 2048, 6)
    # greedy verification's form (argmaxes in the graph) picks what the logits do
    full = gpu.forward(fam, cfg, wg, kg, toks, n + mask.sum(1) - 1, mask)
    kg.commit([])
    for _ in range(2):  # eagerly, then its recorded graph
        greedy = gpu.forward_greedy(fam, cfg, wg, kg, toks, n + mask.sum(1) - 1, mask)
        kg.commit([])
        assert list(greedy.ids) == list(full.argmax(1))
    np.testing.assert_array_equal(greedy[5], full[5])
    both(toks, n + mask.sum(1) - 1, mask=mask, accept=[0, 1, 3])
    both([7], [n + 3])
    assert kg.n_past == kc.n_past == n + 4


def test_random_gemma3_matches_cpu(tmp_path):
    """Gemma 3's path on the device: head_dim 256, GeGLU through two products, post-norms,
    Gemma-3-270M's tensor types (Q5_0, Q8_0, Q4_K, Q6_K), six layers (one global, five
    with a 32-token window, so a 100-token prompt and 24 decode steps pass it; the global
    one's positions scaled by 1/8), against the CPU backend within the same tolerance."""
    import gguf
    from luce.bench.synthetic import tiny, write_gguf
    from luce.gguf_file import GGUFFile
    from luce.plugins import family_for
    Q = gguf.GGMLQuantizationType
    shape = tiny("gemma3", 1024, n_layers=6, n_embd=640, n_ff=2048, n_heads=4, n_kv_heads=1, head_dim=256,
                 sliding_window=32, rope_scaling=8.0)  # 4B-27B's linear RoPE scaling in the global layer

    def types(n):  # as in gemma3-270m-q4-k-m
        if "norm" in n:
            return Q.F32
        for part, t in (("token_embd", Q.Q8_0), ("attn_v", Q.Q8_0), ("attn_output", Q.Q4_K),
                        ("ffn_down", Q.Q6_K)):
            if part in n:
                return t
        return Q.Q5_0
    path = write_gguf(tmp_path / "g3.gguf", shape, types=types, seed=6)
    f = GGUFFile(path)
    fam = family_for(path, f.architecture)
    cfg = fam.read_config(f)
    assert fam.name == "gemma3" and cfg.layer_window(5) is None and cfg.layer_window(4) == 32
    assert cfg.layer_rope_scale(5) == 0.125 and cfg.layer_rope_scale(4) == 1.0
    both, _ = _cpu_and_gpu(fam, cfg, f, 256)

    rng = np.random.default_rng(1)
    logits = both(rng.integers(0, 1024, 100), np.arange(100), rows=[99])
    for i in range(24):
        logits = both([int(logits[-1].argmax())], [100 + i])


@pytest.mark.parametrize("setting", ["1", "0"])
def test_pdl_decode_matches_cpu(setting):
    """LUCE_PDL (luce.kernels.pdl: the decode graph's kernels launched before the one
    before them has finished, waiting on it in their first instruction; on by default):
    the same CPU-against-GPU run as test_random_qwen3_matches_cpu, in a fresh interpreter
    (the setting is read before any kernel compiles), with programmatic edges in its
    graphs when on and none when off (LUCE_PDL=0: every edge a full dependency)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    on = setting == "1"
    script = (
        "import sys, tempfile, pathlib\n"
        f"sys.path.insert(0, {str(root / 'tests' / 'gpu')!r})\n"
        "from luce.kernels import pdl\n"
        f"assert pdl.ENABLED == {on}, 'LUCE_PDL=1 needs compute capability 9.0+'\n"
        "from test_cuda_backend_synthetic_gpu import test_random_qwen3_matches_cpu\n"
        "from luce.backends import cuda_graph\n"
        "test_random_qwen3_matches_cpu(pathlib.Path(tempfile.mkdtemp()))\n"
        "print('STATS', cuda_graph.STATS)\n"
        f"assert (cuda_graph.STATS['programmatic'] > 0) == {on}, cuda_graph.STATS\n")
    env = dict(os.environ, LUCE_PDL=setting, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]


def test_sampled_decode_on_the_device_draws_the_host_samplers_tokens(tmp_path):
    """generate with a temperature takes DeviceStepper on the GPU (the draw inside the
    decode graph, the next step queued before the token is read): for a seed, the tokens
    of the host sampler over the same backend's logits (PlainStepper); with penalties too
    (the device keeps the history's counts and repeat window itself)."""
    import luce
    from luce.bench.synthetic import tiny, write_gguf
    from luce.engine.generator import DeviceStepper, PlainStepper, device_steps, generate
    from luce.engine.sampling import Sampler, SamplingParams
    shape = tiny("qwen3", 2048, n_layers=2, n_embd=512, n_ff=1024, n_heads=8, n_kv_heads=2, head_dim=128)
    m = luce.load(write_gguf(tmp_path / "q3.gguf", shape, seed=6), backend="cuda", n_ctx=256)
    prompt = list(np.random.default_rng(2).integers(0, 2048, 30))
    runs = []
    for seed, penalties in ((1, {}), (2, {}), (3, {"repeat_penalty": 1.3, "presence_penalty": 0.3,
                                                    "frequency_penalty": 0.1, "repeat_last_n": 8})):
        params = SamplingParams(temperature=1.2, top_k=40, top_p=0.97, min_p=0.0, seed=seed, max_tokens=48,
                                ignore_eos=True, **penalties)
        s_dev, s_host = m.new_session(256), m.new_session(256)
        assert device_steps(s_dev, params)
        dev = DeviceStepper(s_dev, params.max_tokens, Sampler(params))
        got = [t for d in generate(s_dev, prompt, params, stepper=dev) for t in d.token_ids]
        want = [t for d in generate(s_host, prompt, params, stepper=PlainStepper(s_host, Sampler(params)))
                for t in d.token_ids]
        assert got == want and len(got) == 48
        runs.append(got)
    # drawn, not one greedy loop (a random-weight model's logits are peaked: few distinct tokens)
    assert runs[0] != runs[1]
