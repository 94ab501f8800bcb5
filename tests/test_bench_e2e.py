"""`luce bench MODEL` end to end on the CPU backend with a tiny random model: every row of
its summary is measured (greedy, sampled on the host, verification widths)."""
import numpy as np


def test_bench_runs_on_cpu(tmp_path, capsys):
    from luce.bench import e2e
    from luce.bench.synthetic import tiny, write_gguf
    path = write_gguf(tmp_path / "t.gguf", tiny("qwen3", 512, n_layers=1, n_embd=64, n_ff=128, n_heads=2,
                                                n_kv_heads=1, head_dim=32), seed=2)
    summary, verify, _ = e2e.run(model=str(path), backend="cpu", n_prompt=16, n_gen=8, long_ctx=40, n_long=4,
                                 verify_widths=(1, 4), record=False, per_op=False)
    row = summary[0]
    for key in ("prefill tok/s", "decode tok/s", "decode tok/s, sampled (default sampling)",
                "first prefill + 4 decode steps s", "decode tok/s @40"):
        assert np.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert [r["nodes"] for r in verify] == [1, 4] and verify[0]["x decode step"] == 1.0
    # the widths again over the long context, in a table of their own
    out = capsys.readouterr()
    assert "verify 4 nodes @40:" in out.err and "tree verification cost (40 tokens in context)" in out.out


def _tiny_shapes(monkeypatch, tmp_path):
    """The 8B and 0.6B synthetic names as tiny shapes of the same family (CPU runs)."""
    from luce.bench import synthetic as S
    monkeypatch.setenv("LUCE_CACHE", str(tmp_path))
    monkeypatch.setitem(S.SHAPES, "qwen3-8b", S.tiny("qwen3", 512, n_layers=2, n_embd=64, n_ff=128, n_heads=2,
                                                      n_kv_heads=1, head_dim=32))
    monkeypatch.setitem(S.SHAPES, "qwen3-0.6b", S.tiny("qwen3", 512, n_layers=1, n_embd=32, n_ff=64, n_heads=2,
                                                        n_kv_heads=1, head_dim=16))


def test_bench_spec_sweeps_draft_max(tmp_path, monkeypatch):
    """`--draft-max 4,auto`: each depth a config of its own over one load, each lossless;
    the projection only where the pair's acceptance was measured at that depth (not auto);
    the breakdown of a target forward's time adds up to it."""
    from click.testing import CliRunner

    from luce.bench.spec import PAIR_ACCEPTANCE_AT, load_prompts
    from luce.cli import main
    _tiny_shapes(monkeypatch, tmp_path)
    args = ["bench", "--spec", "--synthetic", "qwen3-8b", "--backend", "cpu", "--gen-tokens", "5", "--categories",
            "code", "--no-record", "--spec-modes", "off,ddtree"]
    r = CliRunner().invoke(main, args + ["--draft-max", "4,auto", "--profile", "5"])
    assert r.exit_code == 0, r.output
    # the host's work by function: cProfile's table of the speculative runs, 5 rows
    prof = r.output.split("host work of the speculative runs by function")[1]
    assert "ncalls" in prof and "tottime" in prof
    assert r.output.count(" loaded in ") == 2  # target and draft, once for both depths
    n_code = len(load_prompts(categories=("code",)))
    table = [line.split("|") for line in r.output.splitlines() if line.startswith("| ")]
    rows = {c[1].strip(): c for c in table if len(c) == 16 and c[2].strip() == "all"}
    assert set(rows) == {"off", "ddtree@4", "ddtree@auto"}, r.output
    for label in ("ddtree@4", "ddtree@auto"):
        assert rows[label][13].strip() == f"{n_code}/{n_code}", rows[label]
        # a draft of 4 is 4 draft forwards a target forward (a prompt's prefill adds one)
        fw = float(rows[label][12])
        assert (4 <= fw <= 4 + 1 / 5 + 1e-9) if label == "ddtree@4" else fw >= 2
    proj = {c[1].strip(): c for c in table if len(c) == 9 and c[2].strip() == "code"}
    assert set(proj) == {"ddtree@4"}, r.output
    assert float(proj["ddtree@4"][4]) == round(PAIR_ACCEPTANCE_AT[4][("ddtree", "code")], 2)
    assert "128 tokens a prompt" not in r.output  # measured at 6, 8 and 10 only
    phases = {c[1].strip(): [float(x) for x in c[2:11]] for c in table if len(c) == 12 and c[1].strip() != "config"
              and not c[1].startswith("-")}
    assert set(phases) == {"ddtree@4", "ddtree@auto"}, r.output
    for cells in phases.values():
        *parts, other, total = cells
        assert all(p >= 0 for p in parts) and parts[1] == parts[4] == 0  # the CPU never waits on a GPU
        assert total > 0 and abs(sum(parts) + other - total) <= 0.005 * len(cells) and other > -0.01 * total
    # at 6: both projections, each with its own acceptance
    r = CliRunner().invoke(main, args + ["--draft-max", "6"])
    assert r.exit_code == 0, r.output
    from luce.bench.spec import PAIR_ACCEPTANCE_LONG_AT
    parts = r.output.split("128 tokens a prompt")
    assert len(parts) == 2, r.output
    short, long = (next(c for c in (line.split("|") for line in part.splitlines())
                        if len(c) == 9 and c[1].strip() == "ddtree") for part in parts)
    assert float(short[4]) == round(PAIR_ACCEPTANCE_AT[6][("ddtree", "code")], 2)
    assert float(long[4]) == round(PAIR_ACCEPTANCE_LONG_AT[6][("ddtree", "code")], 2)
    assert short[3] == long[3]  # the same run's cost of a forward
    r = CliRunner().invoke(main, args + ["--draft-max", "4,x"])
    assert r.exit_code == 2 and "--draft-max" in r.output


def test_bench_spec_synthetic(tmp_path, monkeypatch):
    """`luce bench --spec --synthetic NAME`: the shape made in memory (no GGUF written), its
    family's smallest shape as the draft, every speculative output checked against the
    plain one (tiny stand-ins for the real shapes: the CPU backend)."""
    from click.testing import CliRunner

    from luce.bench import synthetic as S
    from luce.bench.spec import load_prompts
    from luce.cli import main
    _tiny_shapes(monkeypatch, tmp_path)
    args = ["bench", "--spec", "--synthetic", "qwen3-8b", "--backend", "cpu", "--gen-tokens", "6", "--categories",
            "code", "--no-record"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "target synthetic:qwen3-8b loaded" in r.output and "draft synthetic:qwen3-0.6b loaded" in r.output
    off = [line for line in r.output.splitlines() if line.startswith("off ")]
    assert off and all(1 <= int(line.rsplit("distinct tokens", 1)[1]) <= 6 for line in off)
    assert not list(tmp_path.rglob("*.gguf*"))  # nothing written
    rows = {line.split("|")[1].strip(): line for line in r.output.splitlines() if line.endswith("|")
            and line.split("|")[2].strip() == "all"}
    assert set(rows) == {"off", "chain", "ddtree"}
    n_code = len(load_prompts(categories=("code",)))
    for mode in ("chain", "ddtree"):
        assert rows[mode].split("|")[13].strip() == f"{n_code}/{n_code}", rows[mode]  # lossless, every prompt
    # the projection: the pair's acceptance over this run's cost of a target forward
    from luce.bench.spec import PAIR_ACCEPTANCE
    # (the first projection: 48 tokens a prompt, as this run; the second, over 128, has DDTree only)
    proj = {c[1].strip(): c for c in (line.split("|") for line in r.output.split("128 tokens a prompt")[0].splitlines())
            if len(c) == 9 and c[2].strip() == "code" and c[1].strip() in ("chain", "ddtree")}
    assert set(proj) == {"chain", "ddtree"}, r.output
    for mode, c in proj.items():
        ms, acc, tps, plain, x = float(c[3]), float(c[4]), float(c[5]), float(c[6]), float(c[7].strip(" x"))
        assert acc == PAIR_ACCEPTANCE[(mode, "code")]
        assert abs(tps - acc * 1e3 / ms) <= 0.05 * tps + 0.1 and abs(x - tps / plain) <= 0.01 + 0.01 * x
    # the draft's step alone against a whole draft (draft max 8): figures that fit together
    # (a host-loop draft here: no top-k step of its own, so the plain step is the unit)
    cost = next(line.split("|") for line in r.output.splitlines() if line.startswith("| ") and len(line.split("|")) == 7
                and line.split("|")[1].strip()[:1].isdigit())
    assert cost[2].strip() == "-"
    step, n_step, prop, ratio = (float(cost[i]) for i in (1, 3, 4, 5))
    assert step > 0 and prop > 0 and abs(n_step - 8 * step) <= 0.01 + 1e-3 * n_step
    assert abs(ratio - prop / (8 * step)) <= 0.01 + 0.01 * ratio
    # on a backend with graphs every prompt runs once in every mode before the timed runs
    # (each prompt's prefill pieces may bring widths whose graphs are not yet captured)
    import luce.spec
    from luce.backends.cpu import CPUBackend
    monkeypatch.setattr(CPUBackend, "use_graphs", True, raising=False)
    # a backend that counts its forwards by how they ran (the CUDA backend's forward_counts):
    # the bench says how many of the timed runs' forwards were recorded or eager
    monkeypatch.setattr(CPUBackend, "forward_counts", {"replayed": 0, "captured": 0, "eager": 0}, raising=False)
    runs = []
    stream = luce.spec.stream
    monkeypatch.setattr(luce.spec, "stream", lambda model, ids, *a, **k: runs.append(tuple(ids)) or stream(
        model, ids, *a, **k))
    r = CliRunner().invoke(main, args + ["--draft", "synthetic:qwen3-0.6b"])
    assert r.exit_code == 0, r.output
    assert "warm-up" in r.output
    assert len(runs) == 2 * 3 * n_code and len(set(runs)) == n_code and runs[:3 * n_code] == runs[3 * n_code:]
    counted = [line for line in r.output.splitlines() if "forwards in the timed runs:" in line]
    assert [line.split(" forwards")[0] for line in counted] == ["draft", "target"], counted
    assert all(line.endswith("replayed 0, captured 0, eager 0") for line in counted)
    # a draft on the target's own backend: one line for both
    import luce
    from luce.bench.spec import run as run_spec
    m = luce.load("synthetic:qwen3-0.6b", backend="cpu", n_ctx=256)
    said = []
    run_spec(m, m, modes=("off", "chain"), categories=("code",), limit=1, max_tokens=3, n_ctx=256, echo=said.append)
    assert [x for x in said if "forwards in the timed runs:" in x] == [
        "target and draft forwards in the timed runs: replayed 0, captured 0, eager 0"]
    rows = {line.split("|")[1].strip(): line for line in r.output.splitlines() if line.endswith("|")
            and line.split("|")[2].strip() == "all"}
    assert rows["ddtree"].split("|")[13].strip() == f"{n_code}/{n_code}", rows["ddtree"]
    r = CliRunner().invoke(main, ["bench", "--spec", "--synthetic", "llama-3-8b", "--backend", "cpu"])
    assert r.exit_code != 0 and "give --draft" in r.output
    # the modes, budget and depth reach the run: a one-node tree commits at most two
    # tokens a forward, so a perfect draft (the target itself) accepts exactly 2
    r = CliRunner().invoke(main, ["bench", "--spec", "--synthetic", "qwen3-8b", "--draft", "synthetic:qwen3-8b",
                                  "--backend", "cpu", "--gen-tokens", "6", "--categories", "code", "--no-record",
                                  "--spec-modes", "off,ddtree", "--ddtree-budget", "1", "--draft-max", "3"])
    assert r.exit_code == 0, r.output
    rows = {line.split("|")[1].strip(): line.split("|") for line in r.output.splitlines() if line.endswith("|")
            and line.split("|")[2].strip() == "all"}
    assert set(rows) == {"off", "ddtree"}
    assert float(rows["ddtree"][6]) == 2.0, rows["ddtree"]
    assert "no projection" in r.output  # the pair's acceptance was measured at budget 22, depth 8
    r = CliRunner().invoke(main, args + ["--spec-modes", "off,tree"])
    assert r.exit_code != 0 and "--spec-modes" in r.output


def test_pipelined_steps_queue_as_their_loops_do():
    """The bench's timing of queued one-token steps: the first takes the token, the rest
    the one left on the device; never more pending than `in_flight` (a draft's steps with
    their top-k: its readback slots; decode: two); every result read; the cache put back."""
    from types import SimpleNamespace

    from luce.bench.e2e import _decode_pipelined

    class Cache:
        n_past = 10

        def commit(self):
            self.n_past += 1

        def truncate(self, n):
            self.n_past = n

    events, pending = [], []

    class Pending:
        def result(self):
            pending.remove(self)
            events.append("read")

    def step(limit, kind):
        def queue(fam, cfg, w, kv, tok, pos, *rest, **kw):
            assert pos == kv.n_past and len(pending) < limit, "more pending than the loop allows"
            events.append((kind, tok))
            pending.append(Pending())
            return pending[-1]
        return queue

    be = SimpleNamespace(forward_topk=step(3, "topk"), forward_next_token=step(2, "next"))
    kv = Cache()
    assert _decode_pipelined(be, None, None, None, kv, 7, 5, topk=4, in_flight=3) >= 0
    t = [("topk", 7), ("topk", None), ("topk", None), "read", ("topk", None), "read", ("topk", None), "read",
         "read", "read"]
    assert events == t * 2 and not pending and kv.n_past == 10
    events.clear()
    assert _decode_pipelined(be, None, None, None, kv, 7, 3) >= 0
    d = [("next", 7), ("next", None), "read", ("next", None), "read", "read"]
    assert events == d * 2 and not pending and kv.n_past == 10


def test_bench_spec_draft_lookup(tmp_path, monkeypatch):
    """`luce bench --spec --draft-lookup 0,1`: each speculative mode with and without the
    draft's chain seeded by prompt lookup, both lossless, the seeded counts echoed."""
    from click.testing import CliRunner

    from luce.bench.spec import load_prompts
    from luce.cli import main
    _tiny_shapes(monkeypatch, tmp_path)
    args = ["bench", "--spec", "--synthetic", "qwen3-8b", "--backend", "cpu", "--gen-tokens", "12", "--categories",
            "edit", "--spec-modes", "off,ddtree", "--draft-lookup", "0,1", "--no-record"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    rows = {line.split("|")[1].strip(): line for line in r.output.splitlines() if line.endswith("|")
            and line.split("|")[2].strip() == "all"}
    assert set(rows) == {"off", "ddtree", "ddtree+seed"}
    n = len(load_prompts(categories=("edit",)))
    for mode in ("ddtree", "ddtree+seed"):
        assert rows[mode].split("|")[13].strip() == f"{n}/{n}", rows[mode]
    assert sum(line.startswith("ddtree+seed ") and " seeded " in line for line in r.output.splitlines()) == n
