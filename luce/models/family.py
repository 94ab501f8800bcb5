"""What a model family declares: data, validated when it is registered.

A family is a plugin's answer to "how do I run a GGUF whose `general.architecture` is X":
how its config is read, which forward runs it, its chat format, default sampling, the
drafts it pairs with and the optimizations it supports. Everything here is plain data
(plus a few callables); `ModelFamily.validate()` checks it field by field and the plugin
manager calls it at registration, naming the plugin and the field in any error.
See docs/plugins.md.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import LuceError
from ..gguf_file import GGUFFile
from .config import ModelConfig

DRAFT_KINDS = ("model", "lookup")
TOOL_CALL_FORMATS = ("auto", "hermes", "qwen-xml", "json", None)
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.\-]*$")


class FamilyDeclarationError(LuceError):
    """A family declaration is invalid: names the plugin, the family and the field."""

    def __init__(self, field: str, problem: str, family: str | None = None, plugin: str | None = None):
        self.field = field
        self.problem = problem
        self.family = family
        self.plugin = plugin
        where = []
        if plugin:
            where.append(f"plugin {plugin!r}")
        if family:
            where.append(f"family {family!r}")
        where.append(f"field {field!r}")
        super().__init__(f"{': '.join(where)}: {problem}")

    def located(self, family: str | None = None, plugin: str | None = None) -> "FamilyDeclarationError":
        return FamilyDeclarationError(self.field, self.problem, family or self.family, plugin or self.plugin)


class DraftUnavailableError(LuceError):
    """A declared draft model could not be found (resolved lazily, when it is needed)."""


# -- drafts --------------------------------------------------------------------------

def _normalize_id(s: str) -> str:
    return re.sub(r"[\s_]+", "-", str(s).strip().lower())


def model_identities(f: GGUFFile) -> list[str]:
    """The names a draft's `targets` globs are matched against (lower case, spaces and
    underscores as '-'): `basename-size_label`, `general.name`, and the file's stem."""
    ids = []
    base, size = f.get("general.basename"), f.get("general.size_label")
    if isinstance(base, str) and isinstance(size, str):
        ids.append(_normalize_id(f"{base}-{size}"))
    name = f.get("general.name")
    if isinstance(name, str):
        ids.append(_normalize_id(name))
    ids.append(_normalize_id(f.path.stem))
    return ids


def _search_dirs() -> list[Path]:
    dirs = []
    for env in ("LUCE_DRAFT_DIR", "LUCE_CACHE", "LUCE_MODEL_CACHE"):
        v = os.environ.get(env)
        if v:
            dirs.append(Path(v) / "models" if env == "LUCE_CACHE" else Path(v))
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    dirs.append(cache / "luce" / "models")
    hub = os.environ.get("HF_HUB_CACHE") or (Path(os.environ["HF_HOME"]) / "hub" if os.environ.get("HF_HOME")
                                             else cache / "huggingface" / "hub")
    dirs.append(Path(hub))
    return dirs


def find_local_gguf(*patterns: str) -> Callable[[], Path | None]:
    """A finder for DraftModel: the first GGUF (case-insensitive glob over file names)
    in $LUCE_DRAFT_DIR, luce's model cache or the Hugging Face hub cache; None if absent.
    Looks only on disk: never downloads."""
    pats = tuple(p.lower() for p in patterns)

    def find() -> Path | None:
        for d in _search_dirs():
            if not d.is_dir():
                continue
            for root, _dirs, files in os.walk(d, followlinks=True):
                for fn in sorted(files):
                    if any(fnmatch.fnmatch(fn.lower(), p) for p in pats):
                        return Path(root) / fn
        return None

    find.__doc__ = f"a local GGUF matching {', '.join(patterns)}"
    find.where = "$LUCE_DRAFT_DIR, ~/.cache/luce/models or the Hugging Face hub cache"  # type: ignore[attr-defined]
    find.patterns = patterns  # type: ignore[attr-defined]
    return find


class DraftModel:
    """A draft model found lazily: `finders` are tried in order when the draft is first
    needed (each returns a path, or None, or raises); nothing is looked up at
    registration. `str()` is its name; calling it returns the path or raises
    DraftUnavailableError saying where it looked and `hint` (how to get the model)."""

    def __init__(self, name: str, *finders: Callable[[], Any], hint: str = ""):
        self.name = name
        self.finders = finders
        self.hint = hint

    def __call__(self) -> Path:
        tried = []
        for find in self.finders:
            try:
                p = find()
            except Exception as e:  # a missing part package, an unreadable cache
                tried.append(f"{_describe(find)}: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}")
                continue
            if p is not None and Path(p).is_file():
                return Path(p)
            tried.append(f"{_describe(find)}: not found" + (f" in {find.where}" if hasattr(find, "where") else ""))
        msg = f"draft model {self.name} is not available ({'; '.join(tried) or 'no finder'})"
        if self.hint:
            msg += f"; {self.hint}"
        raise DraftUnavailableError(msg)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"DraftModel({self.name!r})"


def _describe(find) -> str:
    doc = (getattr(find, "__doc__", None) or "").strip().splitlines()
    return doc[0] if doc else getattr(find, "__name__", "finder")


@dataclass(frozen=True)
class DraftSpec:
    """A draft a family pairs with.

    kind: "model" (a same-tokenizer autoregressive draft model) or "lookup" (prompt
    n-gram lookup, no model). model (kind "model"): a path, a Hugging Face
    `owner/repo:file.gguf`, or a callable returning a path (e.g. DraftModel), resolved
    only when the draft is used. targets: globs over the target model's identities
    (see model_identities, e.g. "qwen2.5-coder-1.5b*"); empty means every model of the
    family. options: settings passed to the drafter (e.g. {"max_ngram": 4}).
    """
    kind: str
    model: Any = None
    description: str = ""
    targets: tuple[str, ...] = ()
    name: str = ""
    options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name or (str(self.model) if self.model is not None else self.kind)

    def applies_to(self, f: GGUFFile) -> bool:
        """Whether this draft pairs with the model in `f` (never with itself)."""
        ids = model_identities(f)
        if self.kind == "model" and self.name and _normalize_id(self.name) in ids:
            return False
        if not self.targets:
            return True
        return any(fnmatch.fnmatch(i, t.lower()) for i in ids for t in self.targets)

    def resolve(self) -> Path | None:
        """The draft model's local path (None for kinds without a model); raises
        DraftUnavailableError when it cannot be found."""
        if self.kind != "model":
            return None
        m = self.model
        if callable(m):
            p = m()
            if p is None or not Path(p).is_file():
                raise DraftUnavailableError(f"draft model {self.label} is not available (resolver returned {p!r})")
            return Path(p)
        from .bundled import resolve_model
        p = resolve_model(m)
        if not Path(p).is_file():
            raise DraftUnavailableError(f"draft model {self.label}: no such file {p}")
        return Path(p)

    def __str__(self) -> str:
        return f"{self.kind}:{self.label}" if self.kind == "model" else self.kind


# -- chat format, optimizations -----------------------------------------------------

@dataclass(frozen=True)
class ChatFormat:
    """How the family's chat output is parsed: tool_call_format is one of
    TOOL_CALL_FORMATS ("hermes": <tool_call>{json}</tool_call>, "qwen-xml":
    <tool_call><function=...>, "json": a bare JSON object, "auto": detect, None: no tool
    calls); reasoning: the model emits reasoning between reasoning_markers."""
    tool_call_format: str | None = "auto"
    reasoning: bool = False
    reasoning_markers: tuple[str, str] = ("<think>", "</think>")


@dataclass(frozen=True)
class Optimizations:
    """The optimizations a family supports, each with its default. None (or False)
    means unsupported/off for the family.

    ddtree_budget: nodes in a DDTree speculative verification tree (int >= 1).
    prefill_compression: fraction of a long prompt's KV rows kept after prefill, in
        (0, 1]; None: the family does not support prompt compression.
    kv_paging: the KV cache may be paged (blocks of kv_page_size tokens).
    kv_page_size: tokens per KV block (>= 1).
    kv_types: KV cache element types the family supports; the first is the default.
    sliding_window: honour the GGUF's `{arch}.attention.sliding_window` (windowed layers
        keep only the last window of KV rows).
    """
    ddtree_budget: int | None = None
    prefill_compression: float | None = None
    kv_paging: bool = True
    kv_page_size: int = 64
    kv_types: tuple[str, ...] = ("f16",)
    sliding_window: bool = True

    # dict-like reading, so `fam.optimizations["ddtree_budget"]` and `.items()` work
    def items(self) -> Iterator[tuple[str, Any]]:
        return iter([(f.name, getattr(self, f.name)) for f in fields(self)])

    def keys(self):
        return [f.name for f in fields(self)]

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default) if key in self.keys() else default

    def as_dict(self) -> dict:
        return dict(self.items())


# -- the family ---------------------------------------------------------------------

@dataclass(frozen=True)
class ModelFamily:
    """A model family. Declare it with plain values; `validate()` (run at registration)
    returns a normalized copy: lists become tuples, an `optimizations` dict becomes
    Optimizations.

    name: identifier ([a-z0-9][a-z0-9_.-]*), unique among registered families.
    architectures: the GGUF `general.architecture` values this family loads.
    read_config: GGUFFile -> ModelConfig (luce.models.config.read_config with flags
        covers llama-like models).
    forward: forward(cfg, weights, ops, kv, tokens, positions, mask, logits_rows) written
        against a backend's op interface, so one function serves the CPU reference (numpy
        ops) and CUDA; None means luce.models.transformer.forward.
    chat_format: ChatFormat. sampling_defaults: SamplingParams fields (e.g. temperature).
    drafts: DraftSpecs. optimizations: Optimizations (or a dict of its fields).
    plugin: set by the plugin manager to the distribution that registered the family.
    """
    name: str
    architectures: tuple[str, ...]
    read_config: Callable[[GGUFFile], ModelConfig]
    forward: Callable | None = None
    chat_format: ChatFormat = field(default_factory=ChatFormat)
    sampling_defaults: dict = field(default_factory=dict)
    drafts: tuple[DraftSpec, ...] = ()
    optimizations: Optimizations = field(default_factory=Optimizations)
    description: str = ""
    plugin: str = ""

    def run_forward(self, *args, **kwargs):
        from . import transformer
        return (self.forward or transformer.forward)(*args, **kwargs)

    def drafts_for(self, f: GGUFFile) -> tuple[DraftSpec, ...]:
        """The drafts that pair with the model in `f`."""
        return tuple(d for d in self.drafts if d.applies_to(f))

    def validate(self) -> "ModelFamily":
        """A normalized copy, or FamilyDeclarationError naming the first bad field."""
        name = self.name
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise FamilyDeclarationError("name", f"must match [a-z0-9][a-z0-9_.-]*, got {name!r}")

        def err(fld, problem):
            return FamilyDeclarationError(fld, problem, family=name)

        archs = self.architectures
        if isinstance(archs, str):
            raise err("architectures", f"must be a tuple of names, not the string {archs!r} (write ({archs!r},))")
        try:
            archs = tuple(archs)
        except TypeError:
            raise err("architectures", f"must be a tuple of names, got {type(archs).__name__}") from None
        if not archs:
            raise err("architectures", "must name at least one GGUF general.architecture")
        for i, a in enumerate(archs):
            if not isinstance(a, str) or not a.strip() or a != a.strip():
                raise err(f"architectures[{i}]", f"must be a non-empty name without spaces around it, got {a!r}")
        if len(set(archs)) != len(archs):
            raise err("architectures", f"lists a name twice: {archs}")

        if not callable(self.read_config):
            raise err("read_config", f"must be a callable GGUFFile -> ModelConfig, got {self.read_config!r}")
        if self.forward is not None and not callable(self.forward):
            raise err("forward", f"must be callable or None, got {self.forward!r}")

        cf = self.chat_format
        if not isinstance(cf, ChatFormat):
            raise err("chat_format", f"must be a ChatFormat, got {type(cf).__name__}")
        if cf.tool_call_format not in TOOL_CALL_FORMATS:
            raise err("chat_format.tool_call_format",
                      f"must be one of {', '.join(map(repr, TOOL_CALL_FORMATS))}, got {cf.tool_call_format!r}")
        if not isinstance(cf.reasoning, bool):
            raise err("chat_format.reasoning", f"must be True or False, got {cf.reasoning!r}")
        markers = cf.reasoning_markers
        if (not isinstance(markers, (tuple, list)) or len(markers) != 2
                or not all(isinstance(m, str) and m for m in markers)):
            raise err("chat_format.reasoning_markers", f"must be two non-empty strings (open, close), got {markers!r}")
        cf = dataclasses.replace(cf, reasoning_markers=tuple(markers))

        sd = self.sampling_defaults
        if not isinstance(sd, dict):
            raise err("sampling_defaults", f"must be a dict, got {type(sd).__name__}")
        from ..engine.sampling import SamplingParams
        known = {f.name: f for f in fields(SamplingParams)}
        for k, v in sd.items():
            if k not in known:
                raise err(f"sampling_defaults.{k}", f"unknown sampling setting (known: {', '.join(known)})")
            if k in ("stop", "stop_token_ids"):
                if not isinstance(v, (tuple, list)):
                    raise err(f"sampling_defaults.{k}", f"must be a tuple, got {v!r}")
            elif k == "ignore_eos":
                if not isinstance(v, bool):
                    raise err(f"sampling_defaults.{k}", f"must be True or False, got {v!r}")
            elif v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise err(f"sampling_defaults.{k}", f"must be a number, got {v!r}")
        sd = {k: tuple(v) if isinstance(v, list) else v for k, v in sd.items()}
        try:
            SamplingParams().with_(**sd)
        except (ValueError, TypeError) as e:
            raise err("sampling_defaults", str(e)) from None

        drafts = self.drafts
        if isinstance(drafts, DraftSpec):
            raise err("drafts", "must be a tuple of DraftSpec, not one DraftSpec (write (spec,))")
        try:
            drafts = tuple(drafts)
        except TypeError:
            raise err("drafts", f"must be a tuple of DraftSpec, got {type(drafts).__name__}") from None
        norm_drafts = []
        for i, d in enumerate(drafts):
            fld = f"drafts[{i}]"
            if not isinstance(d, DraftSpec):
                raise err(fld, f"must be a DraftSpec, got {type(d).__name__}")
            if d.kind not in DRAFT_KINDS:
                raise err(f"{fld}.kind", f"must be one of {', '.join(map(repr, DRAFT_KINDS))}, got {d.kind!r}")
            if d.kind == "model":
                if d.model is None:
                    raise err(f"{fld}.model", "a draft of kind 'model' needs a model: a path, owner/repo:file.gguf, "
                                              "or a callable returning a path")
                if not (callable(d.model) or isinstance(d.model, (str, os.PathLike))):
                    raise err(f"{fld}.model", f"must be a path, a string or a callable, got {type(d.model).__name__}")
            elif d.model is not None:
                raise err(f"{fld}.model", f"a draft of kind {d.kind!r} takes no model")
            targets = d.targets
            if isinstance(targets, str):
                raise err(f"{fld}.targets", f"must be a tuple of globs, not the string {targets!r}")
            targets = tuple(targets)
            if not all(isinstance(t, str) and t for t in targets):
                raise err(f"{fld}.targets", f"must be non-empty strings, got {targets!r}")
            if not isinstance(d.options, dict) or not all(isinstance(k, str) for k in d.options):
                raise err(f"{fld}.options", f"must be a dict with string keys, got {d.options!r}")
            if not isinstance(d.name, str) or not isinstance(d.description, str):
                raise err(f"{fld}.name", "name and description must be strings")
            norm_drafts.append(dataclasses.replace(d, targets=targets))

        opt = self.optimizations
        if isinstance(opt, dict):
            known_opt = {f.name for f in fields(Optimizations)}
            for k in opt:
                if k not in known_opt:
                    raise err(f"optimizations.{k}", f"unknown optimization (known: {', '.join(sorted(known_opt))})")
            opt = Optimizations(**opt)
        elif not isinstance(opt, Optimizations):
            raise err("optimizations", f"must be an Optimizations or a dict, got {type(opt).__name__}")
        b = opt.ddtree_budget
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise err("optimizations.ddtree_budget", f"must be an int >= 1 or None, got {b!r}")
        pc = opt.prefill_compression
        if pc is not None and (isinstance(pc, bool) or not isinstance(pc, (int, float)) or not 0 < pc <= 1):
            raise err("optimizations.prefill_compression", f"must be a fraction in (0, 1] or None, got {pc!r}")
        for flag in ("kv_paging", "sliding_window"):
            if not isinstance(getattr(opt, flag), bool):
                raise err(f"optimizations.{flag}", f"must be True or False, got {getattr(opt, flag)!r}")
        ps = opt.kv_page_size
        if isinstance(ps, bool) or not isinstance(ps, int) or ps < 1:
            raise err("optimizations.kv_page_size", f"must be an int >= 1, got {ps!r}")
        kv = opt.kv_types
        if isinstance(kv, str):
            raise err("optimizations.kv_types", f"must be a tuple of types, not the string {kv!r}")
        kv = tuple(kv)
        if not kv:
            raise err("optimizations.kv_types", "must list at least one KV type (the first is the default)")
        for t in kv:
            if t not in KV_TYPES:
                raise err("optimizations.kv_types", f"unknown KV type {t!r} (known: {', '.join(KV_TYPES)})")
        opt = dataclasses.replace(opt, kv_types=kv)

        if not isinstance(self.description, str):
            raise err("description", "must be a string")

        return dataclasses.replace(self, architectures=archs, chat_format=cf, sampling_defaults=sd,
                                   drafts=tuple(norm_drafts), optimizations=opt)
