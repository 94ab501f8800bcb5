"""`luce bench --compare VAR=VALUE ...`: the end-to-end bench under several settings, side by side.

Why: most of luce's kernel settings (LUCE_Q6K_G8, LUCE_PDL, ...) are read when the
kernels compile, once a process, so comparing them takes one process each. This runs the
same `luce bench` once without the settings and once with each, in alternating order for
`rounds` rounds (run-to-run spread shows as the spread within a column), and prints each
figure the bench reports as it goes (its progress lines) in one table.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

# a progress line's figure: "[luce bench   59.4 s] decode 309.7 tok/s" -> ("decode", 309.7, "tok/s")
_FIGURE = re.compile(r"^\[luce bench\s+[\d.]+ s\] (.+?):? ([\d,]+(?:\.\d+)?) (tok/s|ms)\b")


def parse_settings(texts) -> list[dict[str, str]]:
    """Each --compare value ("VAR=VALUE[ VAR=VALUE ...]") as a dict; names must be
    environment variables luce reads (LUCE_*, NUMBA_*)."""
    out = []
    for text in texts:
        setting = {}
        for part in text.split():
            name, eq, value = part.partition("=")
            if not eq or not re.fullmatch(r"(LUCE|NUMBA)_[A-Z0-9_]+", name):
                raise ValueError(f"--compare {text!r}: VAR=VALUE pairs of LUCE_* or NUMBA_* settings")
            setting[name] = value
        if not setting:
            raise ValueError("--compare: an empty setting")
        out.append(setting)
    return out


def parse_progress(text: str) -> dict[str, tuple[float, str]]:
    """The figures of a bench run's progress lines: {what: (value, unit)}, the last of each."""
    got = {}
    for line in text.splitlines():
        m = _FIGURE.match(line.strip())
        if m:
            got[m.group(1)] = (float(m.group(2).replace(",", "")), m.group(3))
    return got


def label(setting: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in setting.items()) or "as set"


def run_all(bench_args: list[str], settings: list[dict[str, str]], rounds: int = 1, runner=None) -> list[dict]:
    """Run `luce bench *bench_args --no-record` under the baseline (the environment as it
    is) and each setting, `rounds` times in alternating order. Returns {"setting", "round",
    "figures", "returncode", "tail"} per run; a run that fails keeps its output's tail."""
    runner = runner or subprocess.run
    args = [sys.executable, "-m", "luce.cli", "bench", *bench_args, "--no-record"]
    results = []
    for r in range(rounds):
        for setting in [{}] + settings:
            env = dict(os.environ, **setting)
            print(f"[luce bench compare] round {r + 1}: {label(setting)}", file=sys.stderr, flush=True)
            p = runner(args, env=env, capture_output=True, text=True)
            figures = parse_progress(p.stderr)
            results.append({"setting": label(setting), "round": r + 1, "figures": figures,
                            "returncode": p.returncode, "tail": (p.stdout + p.stderr)[-2000:]})
            # as it goes, so a run cut short by a time limit still shows what finished
            print("[luce bench compare]   " + ("; ".join(f"{n} {_number(v)} {u}" for n, (v, u) in figures.items())
                                               or f"no figures (exit {p.returncode})"), file=sys.stderr, flush=True)
    return results


def _number(v: float) -> str:
    return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4g}"


def table(results: list[dict]) -> list[dict]:
    """One row a figure (in the order they first appear), one column a setting: each
    round's value, "/"-separated; "-" where a run did not report it."""
    settings = list(dict.fromkeys(r["setting"] for r in results))
    names = list(dict.fromkeys(n for r in results for n in r["figures"]))
    rows = []
    for n in names:
        unit = next(r["figures"][n][1] for r in results if n in r["figures"])
        row = {"figure": f"{n} ({unit})"}
        for s in settings:
            vals = [r["figures"].get(n) for r in results if r["setting"] == s]
            row[s] = " / ".join("-" if v is None else _number(v[0]) for v in vals)
        rows.append(row)
    return rows
