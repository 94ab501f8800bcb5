"""`luce bench --compare`: settings parsed, the bench run as set and under each setting in
alternating rounds (environment passed to each child), figures read from the progress
lines into one table; a real run of the command on the CPU with a tiny model."""
import subprocess
import sys

import pytest

from luce.bench import compare as C

LOG = """[luce bench     3.0 s] loaded synthetic qwen3-8b on cuda in 2.92 s
[luce bench    58.9 s] prefill 9,930 tok/s
[luce bench    59.4 s] decode 309.7 tok/s
[luce bench    61.1 s] decode, next token on device: 330.0 tok/s
[luce bench    79.6 s] decode @8192: 278.2 tok/s (89.8% of short)
[luce bench   103.6 s] verify 23 nodes @8192: 6.630 ms (1.87x)
[luce bench   111.7 s] verify 23 nodes: 5.517 ms (1.77x)
"""


def test_progress_lines_give_the_figures():
    got = C.parse_progress(LOG)
    assert got == {"prefill": (9930.0, "tok/s"), "decode": (309.7, "tok/s"),
                   "decode, next token on device": (330.0, "tok/s"), "decode @8192": (278.2, "tok/s"),
                   "verify 23 nodes @8192": (6.63, "ms"), "verify 23 nodes": (5.517, "ms")}


def test_settings_are_environment_assignments():
    assert C.parse_settings(["LUCE_Q6K_G8=0", "LUCE_PDL=0 NUMBA_OPT=2"]) == [
        {"LUCE_Q6K_G8": "0"}, {"LUCE_PDL": "0", "NUMBA_OPT": "2"}]
    for bad in ("PATH=/tmp", "LUCE_PDL", "", "luce_pdl=1"):
        with pytest.raises(ValueError):
            C.parse_settings([bad])


def test_rounds_alternate_and_the_table_lines_them_up():
    calls = []

    def runner(args, env, capture_output, text):
        calls.append((args, env.get("LUCE_X")))
        v = {None: 100.0, "1": 110.0}[env.get("LUCE_X")] + len(calls)
        err = f"[luce bench 1.0 s] decode {v} tok/s\n" + ("" if env.get("LUCE_X") else "[luce bench 2.0 s] verify 23 nodes: 5.5 ms (1.7x)\n")
        return subprocess.CompletedProcess(args, 0, "", err)
    res = C.run_all(["--synthetic", "qwen3-8b"], [{"LUCE_X": "1"}], rounds=2, runner=runner)
    assert [c[1] for c in calls] == [None, "1", None, "1"]
    assert calls[0][0][-4:] == ["bench", "--synthetic", "qwen3-8b", "--no-record"]
    rows = C.table(res)
    assert rows == [{"figure": "decode (tok/s)", "as set": "101.0 / 103.0", "LUCE_X=1": "112.0 / 114.0"},
                    {"figure": "verify 23 nodes (ms)", "as set": "5.5 / 5.5", "LUCE_X=1": "- / -"}]


def test_the_command_on_the_cpu(tmp_path):
    from luce.bench.synthetic import tiny, write_gguf
    path = write_gguf(tmp_path / "t.gguf", tiny("qwen3", 512, n_layers=1, n_embd=64, n_ff=128, n_heads=2,
                                                n_kv_heads=1, head_dim=32), seed=2)
    r = subprocess.run([sys.executable, "-m", "luce.cli", "bench", str(path), "--backend", "cpu", "--prompt-tokens",
                        "8", "--gen-tokens", "4", "--long-ctx", "0", "--verify-widths", "1,2", "--no-breakdown",
                        "--compare", "LUCE_KERNEL_CACHE=0"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if "decode (tok/s)" in line or "verify 2 nodes (ms)" in line]
    assert len(lines) == 2 and "LUCE_KERNEL_CACHE=0" in r.stdout, r.stdout
    assert "round 1: LUCE_KERNEL_CACHE=0" in r.stderr and "round 1: as set" in r.stderr
