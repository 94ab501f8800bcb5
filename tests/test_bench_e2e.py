"""`luce bench MODEL` end to end on the CPU backend with a tiny random model: every row of
its summary is measured (greedy, sampled on the host, verification widths)."""
import numpy as np


def test_bench_runs_on_cpu(tmp_path):
    from luce.bench import e2e
    from luce.bench.synthetic import tiny, write_gguf
    path = write_gguf(tmp_path / "t.gguf", tiny("qwen3", 512, n_layers=1, n_embd=64, n_ff=128, n_heads=2,
                                                n_kv_heads=1, head_dim=32), seed=2)
    summary, verify, _ = e2e.run(model=str(path), backend="cpu", n_prompt=16, n_gen=8, long_ctx=0,
                                 verify_widths=(1, 4), record=False, per_op=False)
    row = summary[0]
    for key in ("prefill tok/s", "decode tok/s", "decode tok/s, sampled (default sampling)",
                "first prefill + 4 decode steps s"):
        assert np.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert [r["nodes"] for r in verify] == [1, 4] and verify[0]["x decode step"] == 1.0
