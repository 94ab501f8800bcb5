"""Benchmark tables: printed with rich, and appended to docs/benchmarks.md with the date,
commit, machine and command that produced them."""
from __future__ import annotations

import datetime
import platform
import subprocess
import sys
from pathlib import Path


def machine() -> str:
    try:
        from numba import cuda
        if cuda.is_available() and not cuda.config.ENABLE_CUDASIM:
            dev = cuda.get_current_device()
            name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
            return f"{name}, {platform.processor() or platform.machine()}"
    except Exception:  # no driver: a CPU machine
        pass
    import os
    return f"CPU only ({os.cpu_count()} cores, {platform.machine()})"


def commit() -> str:
    import os
    if os.environ.get("LUCE_COMMIT"):  # machines that get a copy of the tree without .git
        return os.environ["LUCE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[2], timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parents[2], timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def print_table(title: str, rows: list[dict], columns: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table
    columns = columns or list(rows[0]) if rows else []
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right" if rows and isinstance(rows[0].get(c), (int, float)) else "left")
    for r in rows:
        t.add_row(*[_fmt(r.get(c)) for c in columns])
    Console(stderr=False).print(t)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def append_to_docs(title: str, sections: list[tuple[str, list[dict], list[str]]], notes: str = "",
                   path: str | Path | None = None) -> Path:
    """Append a dated entry; returns the file written."""
    path = Path(path) if path else Path.cwd() / "docs" / "benchmarks.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "luce " + " ".join(sys.argv[1:]) if Path(sys.argv[0]).name in ("luce", "__main__.py", "cli.py") else " ".join(sys.argv)
    parts = [f"\n## {title}\n", f"- date: {now}", f"- commit: {commit()}", f"- machine: {machine()}",
             f"- command: `{cmd}`"]
    if notes:
        parts.append(f"- notes: {notes}")
    for heading, rows, cols in sections:  # rows: dicts, or a table already in markdown
        parts += ["", f"**{heading}**", "", rows if isinstance(rows, str) else markdown_table(rows, cols)]
    if not path.exists():
        path.write_text("# Benchmarks\n\nEvery entry is appended by a `luce bench` run; figures are as measured.\n")
    with open(path, "a") as fh:
        fh.write("\n".join(parts) + "\n")
    return path
