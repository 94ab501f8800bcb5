"""`luce bench --spec`: acceptance length and tok/s with and without speculation on the
fixed prompt set in prompts.jsonl (code, math, chat), greedy.

Acceptance length (tokens committed per target forward) depends only on the two models
and the prompts, not on the machine, so a CPU run measures it; tok/s is the machine's.
Every speculative run's output is also compared with the plain run's, token for token.

    python -m luce.bench.spec --modes off,chain,ddtree --max-tokens 64
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..spec.options import BENCH_DRAFT_MAX, DEFAULT_DRAFT_MAX, draft_max_label, parse_draft_maxes

PROMPTS = Path(__file__).with_name("prompts.jsonl")


@dataclass
class Result:
    mode: str
    prompt_id: str
    category: str
    prompt_tokens: int
    completion_tokens: int
    target_forwards: int
    decode_s: float
    draft_s: float
    verify_s: float
    matches_plain: bool | None
    draft_max: int | None = None  # DRAFT_MAX_AUTO for auto; None for plain decode
    config: str = ""  # the summary's row label: the mode, with the depth in a sweep of several
    phases: dict | None = None  # SpecCounters.phases (seconds)
    draft_ahead: int = 0  # draft steps queued beside each verification (DraftModel.queue_ahead)
    ahead_tries: int = 0  # drafts queued ahead in this run
    ahead_hits: int = 0  # ... that the next step's draft used
    draft_forwards: int = 0  # the draft model's forwards in this run (each a draft step's cost)
    cut_offs: int = 0  # drafts its p-min cut-off ended early (DraftModel.cut_offs)
    draft_lookup: bool = False  # the draft's chain seeded by prompt lookup (DraftModel.lookup)
    seeded: int = 0  # draft tokens a seeded catch-up computed (DraftModel.seeded): no forward of their own

    @property
    def acceptance_length(self) -> float:
        return self.completion_tokens / self.target_forwards if self.target_forwards else 0.0


def load_prompts(path=None, categories=None, limit=None) -> list[dict]:
    rows = [json.loads(line) for line in Path(path or PROMPTS).read_text().splitlines() if line.strip()]
    if categories:
        rows = [r for r in rows if r["category"] in categories]
    return rows[:limit] if limit else rows


def default_pair() -> tuple[Path, Path]:
    """Qwen2.5-Coder-1.5B as target, 0.5B as draft (from their part packages)."""
    from ..models.test_models import qwen_coder_05b_path, qwen_coder_15b_path
    return qwen_coder_15b_path(), qwen_coder_05b_path()


def run(target=None, draft=None, modes=("off", "chain", "ddtree"), prompts=None, categories=None,
        limit=None, max_tokens: int = 64, ddtree_budget: int = 22, draft_max=8, draft_p_min: float = 0.0,
        backend: str = "cpu", n_ctx: int = 1024, out=None, echo=print, costs: dict | None = None,
        profile: int = 0, draft_ahead=0, draft_lookup=False) -> list[Result]:
    """Run every prompt under every mode ("off", "chain", "ddtree", "lookup"). target and
    draft default to the Qwen2.5-Coder 1.5B/0.5B pair; results are appended to `out`
    (JSONL) as they come, since a CPU run takes long. draft_max may be a sequence: every
    speculative mode at each depth, over one load of the models (a result's config then
    names mode and depth, as "ddtree@6"). With `costs` (a dict), the draft's step alone
    and its propose() are timed after the runs (draft_costs) into it, at the first depth.
    profile N > 0: the timed speculative runs under cProfile, its N functions of most own
    time printed after them (host work by function; the runs' times then include the
    profiler's overhead). draft_ahead: the draft steps queued beside each verification
    (DraftModel.queue_ahead), or several: each a config of its own (e.g. "ddtree+ahead7"),
    with how often the next draft used them. draft_lookup: the draft model's chain seeded by
    prompt lookup (DraftModel.lookup), or (False, True): each a config ("ddtree+seed")."""
    depths = tuple(draft_max) if isinstance(draft_max, (list, tuple)) else (draft_max,)
    aheads = tuple(draft_ahead) if isinstance(draft_ahead, (list, tuple)) else (draft_ahead,)
    seeds = tuple(bool(x) for x in draft_lookup) if isinstance(draft_lookup, (list, tuple)) else (bool(draft_lookup),)
    if not depths or not aheads or not seeds:
        raise ValueError("draft_max, draft_ahead: at least one value")
    from ..spec import DraftModel, PromptLookup, SpecOptions, stream

    if target is None:
        target, draft0 = default_pair()
        draft = draft or draft0
    rows = load_prompts(prompts, categories, limit)
    model = _load(target, backend, n_ctx, "target", echo)
    draft_model = None
    if any(m in ("chain", "ddtree") for m in modes) and draft:
        draft_model = _load(draft, backend, n_ctx, "draft", echo)
    plain: dict[str, list[int]] = {}
    results: list[Result] = []
    # One target session and one draft for every run, each reset before it: a run then
    # prefills as a fresh one does (the same logits), while the caches, and on the GPU the
    # graphs captured for them, stay. With a new cache a run, every graph was captured
    # again inside the timed decode (H200, f629c33, Qwen3-8B shape, 0.6B draft: 16.9 ms of
    # draft a target forward in the bench, 10.2 ms for the same 8-token draft timed alone).
    session = model.new_session(n_ctx)
    draft_shared = DraftModel(draft_model, n_ctx=n_ctx, p_min=draft_p_min) if draft_model else None

    def one(mode, depth, ahead, seed, ids, n_tokens):
        opts = SpecOptions(mode=mode, ddtree_budget=ddtree_budget, draft_max=depths[0] if depth is None else depth,
                           draft_p_min=draft_p_min, draft_ahead=ahead)
        drafter = None
        if mode == "lookup" or (mode != "off" and draft_model is None):
            drafter = PromptLookup()
        elif mode != "off":
            drafter = draft_shared
            drafter.reset()
            drafter.lookup = PromptLookup() if seed else None
        session.reset()
        toks, stats = [], None
        for d in stream(model, ids, opts, drafter, session=session, temperature=0, max_tokens=n_tokens):
            toks += d.token_ids
            stats = d.stats or stats
        return toks, stats

    # prompt by prompt, the modes back to back: a shared machine's load then skews
    # them alike; "off" first so the others are checked against its output
    order = [(m, None, 0, False) if m == "off" else (m, d, a, e) for m in sorted(modes, key=lambda m: m != "off")
             for d in (depths[:1] if m == "off" else depths) for a in (aheads[:1] if m == "off" else aheads)
             for e in (seeds[:1] if m in ("off", "lookup") else seeds)]

    def config(mode, depth, ahead, seed):
        label = mode if depth is None or len(depths) == 1 else f"{mode}@{draft_max_label(depth)}"
        return (label + (f"+ahead{ahead}" if mode != "off" and (ahead or len(aheads) > 1) else "")
                + ("+seed" if seed and mode not in ("off", "lookup") else ""))
    if getattr(model.backend, "use_graphs", False) and rows:
        # Graphs are captured the second time a width runs (the first runs eagerly), and
        # a prompt's prefill pieces (powers of two) can bring the draft and the target
        # widths an earlier prompt did not have: every prompt once in every mode, so that
        # the timed runs only replay. (H100, cb6d92b, 32B shape, the first prompt alone
        # warmed up: prompts 2 and 3 ran ~2.4 ms a target forward slower than 1 and 4 in
        # both speculative modes, not in plain decode; whether new widths were the cause
        # was not found.)
        t0 = time.perf_counter()
        for row in rows:
            for mode, depth, ahead, seed in order:
                one(mode, depth, ahead, seed, _prompt_ids(model, row), max_tokens)
        echo(f"warm-up (every prompt once in every mode, not counted) {time.perf_counter() - t0:.1f}s")
    sink = open(out, "a") if out else None
    # backend -> (who runs on it, its counts before the timed runs)
    counted: dict = {}
    for role, m in (("draft", draft_model), ("target", model)):
        if m is not None and hasattr(m.backend, "forward_counts"):
            shared = counted.get(id(m.backend))
            counted[id(m.backend)] = (m.backend, "target and draft" if shared else role, dict(m.backend.forward_counts))
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
    try:
        for row in rows:
            for mode, depth, ahead, seed in order:
                ids = _prompt_ids(model, row)
                tries0, hits0, fw0, cut0, seeded0 = ((draft_shared.ahead_tries, draft_shared.ahead_hits,
                                                      draft_shared.forwards, draft_shared.cut_offs, draft_shared.seeded)
                                                     if draft_shared else (0, 0, 0, 0, 0))
                if prof and mode != "off":
                    prof.enable()
                toks, stats = one(mode, depth, ahead, seed, ids, max_tokens)
                if prof:
                    prof.disable()
                if mode == "off":
                    plain[row["id"]] = toks
                r = Result(mode, row["id"], row["category"], len(ids), stats.completion_tokens,
                           stats.target_forwards, stats.decode_s, stats.draft_s, stats.verify_s,
                           (plain[row["id"]] == toks) if mode != "off" and row["id"] in plain else None,
                           depth, config(mode, depth, ahead, seed), stats.spec_phases, ahead)
                if draft_shared and mode in ("chain", "ddtree"):
                    r.ahead_tries = draft_shared.ahead_tries - tries0
                    r.ahead_hits = draft_shared.ahead_hits - hits0
                    r.draft_forwards = draft_shared.forwards - fw0
                    r.cut_offs = draft_shared.cut_offs - cut0
                    r.draft_lookup, r.seeded = seed, draft_shared.seeded - seeded0
                results.append(r)
                echo(f"{r.config:10s} {row['id']:20s} {r.completion_tokens:4d} tok  {r.target_forwards:4d} fwd  "
                     f"accept {r.acceptance_length:5.2f}  {r.completion_tokens / r.decode_s:6.2f} tok/s"
                     + ("" if r.matches_plain is None else f"  lossless={r.matches_plain}")
                     + (f"  draft forwards {r.draft_forwards}" if r.draft_forwards else "")
                     + (f"  cut off {r.cut_offs}" if r.cut_offs else "")
                     + (f"  seeded {r.seeded}" if r.draft_lookup else "")
                     + (f"  ahead used {r.ahead_hits}/{r.ahead_tries}" if r.ahead_tries else "")
                     # random weights' greedy output is often one or two tokens over and over:
                     # then its lossless check says little
                     + (f"  distinct tokens {len(set(toks))}" if mode == "off" else ""))
                if sink:
                    sink.write(json.dumps({**asdict(r), "acceptance_length": r.acceptance_length,
                                           "max_tokens": max_tokens, "ddtree_budget": ddtree_budget,
                                           "draft_p_min": draft_p_min,
                                           "target": Path(model.path).name,
                                           "draft": Path(draft_model.path).name if draft_model else None,
                                           "tokens": toks}) + "\n")
                    sink.flush()
    finally:
        if sink:
            sink.close()
    for b, role, before in counted.values():
        # graphs recorded or forwards run eagerly inside the timed runs are one-time costs
        # in their figures
        echo(f"{role} forwards in the timed runs: "
             + ", ".join(f"{n} {v - before[n]}" for n, v in b.forward_counts.items()))
    echo(summary(results))
    if prof:
        import io
        import pstats
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(profile)
        echo("host work of the speculative runs by function (cProfile, own time; their tok/s include its "
             "overhead)\n" + text.getvalue())
    if costs is not None and draft_shared is not None and rows:
        # draft max auto: a draft of the default depth (auto's first steps draft that too)
        costs.update(draft_costs(draft_shared, _prompt_ids(model, rows[0]), depths[0] or DEFAULT_DRAFT_MAX))
    return results


def draft_costs(drafter, context: list[int], n: int, reps: int = 8, steps: int = 32) -> dict:
    """Where a draft's time goes: ms of the draft model's one-token step alone (the next
    token left on the device, as `luce bench` times decode), of the same step with its
    candidates' top-k (a device draft's forward_topk, queued back to back as its loop
    does), and of propose(n) after a one-token catch-up (what follows a rejected draft),
    median of `reps`. A propose costs n forwards plus whatever surrounds them."""
    from .e2e import _decode_pipelined
    m = drafter.model
    drafter.reset()
    drafter.propose(context, n)  # the prefill; graphs recorded
    kv = drafter.session.cache
    args = (m.backend, m.family, m.config, m.weights, kv, int(context[-1]), steps)
    step = _decode_pipelined(*args) / steps
    topk_step = _decode_pipelined(*args, topk=drafter.top_k, in_flight=m.backend.readback_slots) / steps \
        if getattr(drafter, "on_device", False) else None
    times = []
    for i in range(reps + 1):  # the first records whatever graph the catch-up's width needs
        t0 = time.perf_counter()
        drafter.propose(context + [1 + i % 7], n)
        times.append(time.perf_counter() - t0)
    out = {"step_ms": 1e3 * step, "topk_step_ms": None if topk_step is None else 1e3 * topk_step,
           "propose_ms": 1e3 * float(np.median(times[1:])), "n": n, "seed_ms": None}
    if topk_step is not None:
        try:  # a row of its own, timed last: its failure should not cost the figures above
            out["seed_ms"] = _seeded_catch_up_ms(drafter, int(context[-1]), reps)
        except Exception as e:  # noqa: BLE001 - reported in the table instead
            out["seed_error"] = f"{type(e).__name__}: {e}"
    return out


def _seeded_catch_up_ms(drafter, token: int, reps: int) -> float | None:
    """ms of a device draft's seeded catch-up (--draft-lookup: seed_width tokens, every row's
    top-k, read back), median of reps, its rows dropped after each; None without room."""
    s = drafter.session
    rows, width = len(s.tokens), drafter.seed_width
    if rows + width > s.n_ctx:
        return None
    times = []
    for _ in range(reps + 1):  # the first records the graph
        t0 = time.perf_counter()
        s.queue_topk([token] * width, drafter.top_k, rows=width).result()
        times.append(time.perf_counter() - t0)
        s.cache.truncate(rows)
    return 1e3 * float(np.median(times[1:]))


def costs_table(c: dict) -> str:
    """draft_costs as a markdown table: the last column is propose against draft max steps
    with their top-k (or, on a host-loop draft, plain steps)."""
    n, step, prop = c["n"], c["step_ms"], c["propose_ms"]
    tk = c.get("topk_step_ms")
    per = tk if tk is not None else step
    table = ("| draft step alone, ms | with its top-k, ms | x draft max | propose(draft max), ms | propose / that |\n"
             "|---|---|---|---|---|\n"
             f"| {step:.3f} | {'-' if tk is None else f'{tk:.3f}'} | {n * per:.2f} | {prop:.2f} | {prop / (n * per):.2f} |")
    if c.get("seed_ms") is not None:  # what --draft-lookup's catch-up costs against one step
        table += (f"\n\nseeded catch-up (--draft-lookup, every row's top-k): {c['seed_ms']:.3f} ms = "
                  f"{c['seed_ms'] / per:.2f} draft steps with their top-k")
    elif c.get("seed_error"):
        table += f"\n\nseeded catch-up not timed: {c['seed_error']}"
    return table


def _load(m, backend, n_ctx, role, echo):
    """A model argument, or an already loaded Model (several runs over one load)."""
    if hasattr(m, "forward"):
        return m
    from ..model import load
    t0 = time.perf_counter()
    model = load(m, backend=backend, n_ctx=n_ctx)
    echo(f"{role} {Path(model.path).name} loaded in {time.perf_counter() - t0:.1f}s")
    return model


def _prompt_ids(model, row) -> list[int]:
    if model.has_chat_template:
        return model.chat_prompt_ids([{"role": "user", "content": row["prompt"]}])
    return model.tokenize(row["prompt"])


def summary(results: list[Result]) -> str:
    """A markdown table: per mode and category, acceptance length (total tokens / total
    target forwards) and decode tok/s."""
    lines = ["| mode | category | prompts | tokens | target forwards | acceptance length | decode tok/s | "
             "draft s | verify s | draft ms / forward | verify ms / forward | draft forwards / forward | lossless | "
             "ahead used |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in results:
        for key in ((_label(r), r.category), (_label(r), "all")):
            groups.setdefault(key, []).append(r)
    modes = list(dict.fromkeys(_label(r) for r in results))
    cats = list(dict.fromkeys(r.category for r in results)) + ["all"]
    for (mode, cat), rs in sorted(groups.items(), key=lambda kv: (modes.index(kv[0][0]), cats.index(kv[0][1]))):
        tok = sum(r.completion_tokens for r in rs)
        fwd = sum(r.target_forwards for r in rs)
        dec = sum(r.decode_s for r in rs)
        checks = [r.matches_plain for r in rs if r.matches_plain is not None]
        lossless = "-" if not checks else f"{sum(checks)}/{len(checks)}"
        dfw = sum(r.draft_forwards for r in rs)
        tries = sum(r.ahead_tries for r in rs)
        used = f"{sum(r.ahead_hits for r in rs)}/{tries}" if tries else "-"
        draft, verify = sum(r.draft_s for r in rs), sum(r.verify_s for r in rs)
        # a step's cost apart from how much it commits: with the acceptance length of
        # another draft pair (measured anywhere: it does not depend on the machine) these
        # give that pair's tok/s on this machine, acceptance / (draft + verify + host)
        lines.append(f"| {mode} | {cat} | {len(rs)} | {tok} | {fwd} | {tok / max(fwd, 1):.2f} | "
                     f"{tok / dec if dec else 0:.2f} | {draft:.1f} | {verify:.1f} | "
                     f"{1e3 * draft / max(fwd, 1):.2f} | {1e3 * verify / max(fwd, 1):.2f} | "
                     f"{f'{dfw / max(fwd, 1):.2f}' if dfw else '-'} | {lossless} | {used} |")
    return "\n".join(lines)


def _label(r: Result) -> str:
    return r.config or r.mode


def phases(results: list[Result]) -> str:
    """A markdown table: per speculative config, where a target forward's wall time goes
    (ms a target forward): the draft's propose (host work, then the part spent waiting on
    the GPU), the tree's build, the verification forward (likewise), the walk down the
    tree, the commit of the accepted rows, and what else the decode loop spent."""
    lines = ["| config | propose: host | propose: GPU wait | tree | forward: host | forward: GPU wait | walk | "
             "commit | other | ms a target forward |", "|---|---|---|---|---|---|---|---|---|---|"]
    by: dict = {}
    for r in results:
        if r.phases:
            by.setdefault(_label(r), []).append(r)
    for label, rs in by.items():
        fwd = max(1, sum(r.target_forwards for r in rs))
        ph = {k: 1e3 * sum(r.phases.get(k, 0.0) for r in rs) / fwd for k in rs[0].phases}
        total = 1e3 * sum(r.decode_s for r in rs) / fwd
        cells = [ph["propose"] - ph["propose wait"], ph["propose wait"], ph["tree"],
                 ph["forward"] - ph["forward wait"], ph["forward wait"], ph["walk"], ph["commit"]]
        lines.append(f"| {label} | " + " | ".join(f"{c:.3f}" for c in cells)
                     + f" | {total - sum(cells):.3f} | {total:.2f} |")
    return "\n".join(lines)


# Acceptance lengths of the Qwen2.5-Coder 0.5B -> 1.5B pair on this prompt set (greedy,
# DDTree budget 22, no p-min; CPU backend, 48 tokens a code prompt and 32 a math or chat
# one; docs/benchmarks.md): at draft max 8 from 68aafc2, at the other depths from the
# forty-fourth session (math and chat there as one figure). Acceptance does not depend on
# the machine: random-weight shapes, which accept about one token a step, are projected
# with these.
PAIR_ACCEPTANCE_AT = {
    4: {("chain", "code"): 3.765, ("ddtree", "code"): 4.267},
    6: {("chain", "code"): 4.683, ("ddtree", "code"): 5.486, ("ddtree", "math"): 4.465, ("ddtree", "chat"): 4.465},
    8: {("chain", "code"): 5.19, ("ddtree", "code"): 6.19, ("chain", "math"): 4.36, ("ddtree", "math"): 5.05,
        ("chain", "chat"): 4.36, ("ddtree", "chat"): 5.05},
    10: {("ddtree", "code"): 6.857, ("ddtree", "math"): 5.333, ("ddtree", "chat"): 5.333},
    12: {("ddtree", "code"): 6.857},
}
PAIR_ACCEPTANCE = PAIR_ACCEPTANCE_AT[BENCH_DRAFT_MAX]
# The same pair later in its outputs: 128 tokens a code prompt (forty-fifth session, CPU,
# 8773b7a), where it agrees for longer and deeper drafts pay more.
PAIR_ACCEPTANCE_LONG_AT = {6: {("ddtree", "code"): 5.89}, 8: {("ddtree", "code"): 7.01},
                           10: {("ddtree", "code"): 8.13}}
PAIR_SETTINGS = {"ddtree_budget": 22, "draft_p_min": 0.0}


def projection(results: list[Result], acceptance_at=None) -> str:
    """A markdown table: per config and category, what speculative decoding would reach at
    this run's cost of a target forward (draft, verification and host time, whatever it
    committed) with the pair's acceptance length at the same draft max: acceptance / (ms a
    forward), against the same run's plain decode. Meant for random-weight runs, whose own
    acceptance is ~1 but whose drafts (no p-min) cost what a real draft's of the same shape
    would. Configs whose acceptance the pair was not measured at (auto, whose depths follow
    acceptance) get no row. acceptance_at: {draft max: {(mode, category): length}}, by
    default PAIR_ACCEPTANCE_AT (48 tokens a prompt); PAIR_ACCEPTANCE_LONG_AT is the same
    over 128."""
    lines = ["| mode | category | ms a target forward | pair acceptance | projected tok/s | plain tok/s | "
             "projected speedup |", "|---|---|---|---|---|---|---|"]
    by: dict = {}
    for r in results:
        by.setdefault((_label(r), r.category), []).append(r)
    for (label, cat), rs in by.items():
        mode, depth = rs[0].mode, rs[0].draft_max
        if rs[0].draft_ahead:
            # its cost a forward depends on how often its guess holds: ~never on random weights
            continue
        table = (PAIR_ACCEPTANCE_AT if acceptance_at is None else acceptance_at).get(
            BENCH_DRAFT_MAX if depth is None else depth, {})
        acc = table.get((mode, cat))
        off = by.get(("off", cat))
        if acc is None:
            continue
        ms = 1e3 * sum(r.decode_s for r in rs) / max(1, sum(r.target_forwards for r in rs))
        tps = acc * 1e3 / ms if ms else 0.0
        plain = sum(r.completion_tokens for r in off) / sum(r.decode_s for r in off) if off else 0.0
        lines.append(f"| {label} | {cat} | {ms:.2f} | {acc:.2f} | {tps:.1f} | "
                     + (f"{plain:.1f} | {tps / plain:.2f}x |" if plain else "- | - |"))
    return "\n".join(lines)


# Drafting policies of the same pair beyond a fixed depth: (acceptance length, draft model
# forwards a target forward) over 128 tokens a code prompt, 64 a math or chat one (CPU,
# forty-sixth session). A policy that drafts less where the draft is unsure spends fewer
# draft steps for the tokens it keeps; with a run's cost of a draft step (cost_line) that
# becomes tok/s. A fixed depth D drafts D forwards a target forward (a prompt's prefill is
# its first catch-up); the p-min rows counted them.
PAIR_POLICIES: dict[str, dict[tuple[str, str], tuple[float, float]]] = {
    "depth 6": {("ddtree", "code"): (5.89, 6.0)},
    "depth 8": {("ddtree", "code"): (7.01, 8.0), ("ddtree", "math"): (5.33, 8.0), ("ddtree", "chat"): (4.17, 8.0)},
    "depth 10": {("ddtree", "code"): (8.13, 10.0)},
    "depth 10, p-min 0.4": {("ddtree", "code"): (7.53, 7.60)},
    "depth 12, p-min 0.2": {("ddtree", "code"): (8.83, 10.29)},
    "depth 12, p-min 0.4 (the default)": {("ddtree", "code"): (8.26, 8.66), ("ddtree", "math"): (4.92, 5.90),
                                          ("ddtree", "chat"): (3.56, 2.91)},
    "depth 14, p-min 0.4": {("ddtree", "code"): (8.68, 9.41)},
}


def cost_line(results: list[Result], mode: str = "ddtree") -> tuple[float, float] | None:
    """(fixed ms, ms a draft forward): a target forward's wall time as a line in the draft
    forwards it took, least squares over this run's fixed-depth configs of `mode` (no draft
    queued ahead); None with fewer than two depths. On random weights a config of depth D
    drafts D forwards a target forward, so the depths spread the points."""
    by: dict = {}
    for r in results:
        if r.mode == mode and r.draft_max and not r.draft_ahead and r.draft_forwards:
            by.setdefault(r.draft_max, []).append(r)
    xs, ys = [], []
    for rs in by.values():
        f = max(1, sum(r.target_forwards for r in rs))
        xs.append(sum(r.draft_forwards for r in rs) / f)
        ys.append(1e3 * sum(r.decode_s for r in rs) / f)
    if len({round(x, 3) for x in xs}) < 2:
        return None
    slope, fixed = np.polyfit(xs, ys, 1)
    return float(fixed), float(slope)


def policy_projection(results: list[Result], policies=None) -> str:
    """A markdown table: each drafting policy of the pair (PAIR_POLICIES: acceptance and
    draft forwards a target forward, measured on the CPU) at this run's cost line, against
    this run's plain decode."""
    lines = ["| policy | category | pair acceptance | draft forwards / forward | projected ms a forward | "
             "projected tok/s | plain tok/s | projected speedup |", "|---|---|---|---|---|---|---|---|"]
    lines_by_mode = {m: cost_line(results, m) for m in {r.mode for r in results}}
    plain_by_cat = {}
    for cat in {r.category for r in results}:
        off = [r for r in results if r.mode == "off" and r.category == cat]
        plain_by_cat[cat] = sum(r.completion_tokens for r in off) / sum(r.decode_s for r in off) if off else 0.0
    for name, table in (PAIR_POLICIES if policies is None else policies).items():
        for (mode, cat), (acc, fw) in table.items():
            line = lines_by_mode.get(mode)
            if line is None or cat not in plain_by_cat:
                continue
            ms = line[0] + line[1] * fw
            plain = plain_by_cat[cat]
            tps = acc * 1e3 / ms
            lines.append(f"| {name} | {cat} | {acc:.2f} | {fw:.2f} | {ms:.2f} | {tps:.1f} | "
                         + (f"{plain:.1f} | {tps / plain:.2f}x |" if plain else "- | - |"))
    return "\n".join(lines)


def parse_aheads(value) -> tuple[int, ...]:
    """--draft-ahead's value in a bench: one number >= 0 or several, comma-separated."""
    try:
        out = tuple(dict.fromkeys(int(v) for v in str(value).split(",") if v.strip()))
    except ValueError:
        out = ()
    if not out or min(out) < 0:
        raise ValueError(f"--draft-ahead: numbers >= 0, comma-separated, not {value!r}")
    return out


def main(argv=None) -> None:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m luce.bench.spec", description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--modes", default="off,chain,ddtree")
    ap.add_argument("--categories")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ddtree-budget", type=int, default=22)
    ap.add_argument("--draft-max", default="8", help="N, auto, or several (4,6,8,auto): each in turn")
    ap.add_argument("--draft-p-min", type=float, default=0.0)
    ap.add_argument("--draft-ahead", default="0", help="draft steps queued beside each verification; several "
                                                       "(0,7): each in turn")
    ap.add_argument("--draft-lookup", default="0", help="1: the draft's chain seeded by prompt lookup; 0,1: both "
                                                        "in turn")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--out")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="the speculative runs under cProfile: its N functions of most own time")
    a = ap.parse_args(argv)
    run(a.target, a.draft, modes=tuple(a.modes.split(",")),
        categories=tuple(a.categories.split(",")) if a.categories else None, limit=a.limit,
        max_tokens=a.max_tokens, ddtree_budget=a.ddtree_budget, draft_max=parse_draft_maxes(a.draft_max),
        draft_p_min=a.draft_p_min, backend=a.backend, draft_ahead=parse_aheads(a.draft_ahead),
        draft_lookup=tuple(v.strip() == "1" for v in a.draft_lookup.split(",") if v.strip()),
        n_ctx=a.ctx, out=a.out, echo=lambda s: print(s, flush=True, file=sys.stdout), profile=a.profile)


if __name__ == "__main__":
    main()
