"""Open a GGUF file: validate it, memory-map its tensors, expose typed metadata.

gguf-py's reader maps the file with numpy.memmap, so tensor data is never copied at
open; a tensor's bytes are only read when a backend dequantizes or uploads them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelFileError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: the last dimension is contiguous
    n_bytes: int
    data: np.ndarray  # uint8 view into the memory map

    @property
    def type_name(self) -> str:
        return self.qtype.name


class ModelMetadata:
    """Typed reading of a model's metadata and tensor table: what a family's read_config and
    build_weights use. GGUFFile reads them from a file; luce.bench.synthetic makes them."""
    path: Path
    metadata: dict
    tensors: dict

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(self.path, "missing general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def get_int(self, key: str, default: int | None = None) -> int:
        v = self.metadata.get(key, default)
        if v is None:
            raise ModelFileError(self.path, f"missing metadata {key!r}")
        if isinstance(v, list):  # some converters store per-layer arrays; all equal for dense models
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ModelFileError(self.path, f"metadata {key!r} should be an integer, got {type(v).__name__}")
        return int(v)

    def get_float(self, key: str, default: float | None = None) -> float:
        v = self.metadata.get(key, default)
        if v is None:
            raise ModelFileError(self.path, f"missing metadata {key!r}")
        if not isinstance(v, (int, float, np.number)) or isinstance(v, bool):
            raise ModelFileError(self.path, f"metadata {key!r} should be a number, got {type(v).__name__}")
        return float(v)

    def get_str(self, key: str, default: str | None = None) -> str | None:
        v = self.metadata.get(key, default)
        if v is not None and not isinstance(v, str):
            raise ModelFileError(self.path, f"metadata {key!r} should be a string")
        return v

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(self.path, f"missing tensor {name!r}") from None


class GGUFFile(ModelMetadata):
    """A validated, memory-mapped GGUF file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        _check_header(self.path)
        import gguf

        try:
            self._reader = gguf.GGUFReader(str(self.path), "r")
        except (ValueError, IndexError, OSError, KeyError, TypeError) as e:
            raise ModelFileError(self.path, f"corrupt GGUF ({_short(e)})") from None
        self.metadata: dict[str, Any] = {}
        for field in self._reader.fields.values():
            if field.name.startswith("GGUF."):
                continue
            try:
                self.metadata[field.name] = field.contents()
            except Exception as e:  # a field that can't be decoded is corruption
                raise ModelFileError(self.path, f"corrupt metadata field {field.name!r} ({_short(e)})") from None
        self.tensors: dict[str, TensorInfo] = {}
        for t in self._reader.tensors:
            qtype = t.tensor_type
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            data = np.asarray(t.data)
            raw = data.view(np.uint8).reshape(-1) if data.dtype != np.uint8 else data.reshape(-1)
            if raw.nbytes != int(t.n_bytes):
                raise ModelFileError(self.path, f"tensor {t.name!r} is truncated")
            self.tensors[t.name] = TensorInfo(t.name, qtype, shape, int(t.n_bytes), raw)

    def require_types(self, supported) -> None:
        """Fail on the first tensor whose type the backends can't decode."""
        for info in self.tensors.values():
            if info.qtype not in supported:
                raise ModelFileError(self.path, f"tensor {info.name!r} has unsupported type {info.type_name}")

    @property
    def n_params(self) -> int:
        return int(sum(int(np.prod(t.shape)) for t in self.tensors.values()))

    @property
    def n_bytes(self) -> int:
        return self.path.stat().st_size


def _short(e: Exception) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return msg[:200]


def _check_header(path: Path) -> None:
    if not path.exists():
        raise ModelFileError(path, "no such file")
    if path.is_dir():
        raise ModelFileError(path, "is a directory, not a GGUF file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ModelFileError(path, "not a GGUF file (bad magic)")
