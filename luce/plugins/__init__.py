"""The plugin manager: luce's own families and every installed `luce` entry point,
loaded through the same hooks (luce.plugins.hookspecs).

Load order: luce's built-in plugin (luce.plugins.builtin), then the entry points of the
`luce` group sorted by distribution and name. Each plugin is imported, registered and
called on its own: a plugin that fails to import, declares a bad family or raises in a
hook is recorded as a PluginProblem naming it (see `problems()` and `luce families`)
and logged, and everything else keeps working.

LUCE_PLUGINS restricts which installed (third-party) plugins load; luce's built-in
families always load. Unset or "all": every plugin. "none" or "": none. Otherwise a
comma- or space-separated list of entry-point or distribution names to load, and/or
names prefixed with "-" to skip (e.g. LUCE_PLUGINS=-luce-broken loads all but that).

Public functions: families(), family_list(), family_for(), plugins(), problems(),
kernels(), kernel_entries(), ops_with_overrides(), register_commands(), reset(),
families_report(). See docs/plugins.md.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import re
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import pluggy

from ..errors import UnknownArchitectureError
from . import hookspecs
from .hookspecs import hookimpl, hookspec  # noqa: F401  (re-exported for plugins)

ENTRY_POINT_GROUP = "luce"
ENV_VAR = "LUCE_PLUGINS"
DOCS = "docs/plugins.md"
BUILTIN = "luce"
BACKENDS = ("*", "cpu", "cuda")

log = logging.getLogger("luce.plugins")

__all__ = [
    "hookimpl", "hookspec", "ENTRY_POINT_GROUP", "ENV_VAR", "PluginInfo", "PluginProblem",
    "plugin_manager", "families", "family_list", "family_for", "plugins", "problems", "kernels",
    "kernel_entries", "ops_with_overrides", "register_commands", "reset", "families_report",
]


@dataclass
class PluginInfo:
    """A plugin luce found: `name` is its entry point's name (BUILTIN for luce's own),
    `dist` and `version` its distribution, `value` what the entry point names."""
    name: str
    dist: str
    version: str
    value: str
    builtin: bool = False
    loaded: bool = False
    pm_name: str = ""

    @property
    def label(self) -> str:
        if _canon(self.name) == _canon(self.dist):
            return self.dist
        return f"{self.dist} (entry point {self.name!r})"


@dataclass(frozen=True)
class PluginProblem:
    """Something a plugin got wrong: `stage` is "import", "register" or a hook name."""
    plugin: str  # distribution name
    entry_point: str
    stage: str
    message: str

    def __str__(self) -> str:
        who = repr(self.plugin) if _canon(self.plugin) == _canon(self.entry_point) else \
            f"{self.plugin!r} (entry point {self.entry_point!r})"
        return f"plugin {who}: {self.stage}: {self.message}"


@dataclass
class _State:
    pm: pluggy.PluginManager
    plugins: list[PluginInfo] = field(default_factory=list)
    arch_map: dict[str, Any] = field(default_factory=dict)  # architecture -> ModelFamily
    by_name: dict[str, Any] = field(default_factory=dict)  # family name -> ModelFamily
    overridden: dict[str, Any] = field(default_factory=dict)  # architecture -> the family it replaced
    kernel_table: dict[tuple[str, str, str], list[tuple[PluginInfo, Callable]]] = field(default_factory=dict)
    problems: list[PluginProblem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    commands_done: set = field(default_factory=set)


_lock = threading.RLock()
_state_obj: _State | None = None


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", str(name)).lower()


# -- loading -------------------------------------------------------------------------

def _selected(ep_name: str, dist: str) -> bool:
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return True
    items = [s for s in re.split(r"[,\s]+", raw.strip()) if s]
    if not items or [_canon(s) for s in items] == ["none"]:
        return False
    include = {_canon(s) for s in items if not s.startswith("-") and _canon(s) != "all"}
    exclude = {_canon(s[1:]) for s in items if s.startswith("-")}
    names = {_canon(ep_name), _canon(dist)}
    if names & exclude:
        return False
    all_named = any(_canon(s) == "all" for s in items)
    return all_named or not include or bool(names & include)


def _entry_points() -> list[tuple[importlib.metadata.EntryPoint, str, str]]:
    seen, out = set(), []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = (getattr(ep.dist, "name", None) or "?") if ep.dist is not None else "?"
        version = ep.dist.version if ep.dist is not None else "?"
        key = (ep.name, ep.value, _canon(dist))
        if key in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add(key)
        out.append((ep, dist, version))
    out.sort(key=lambda t: (_canon(t[1]), t[0].name))
    return out


def _luce_version() -> str:
    try:
        return importlib.metadata.version("luce")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _problem(st: _State, info: PluginInfo, stage: str, message: str) -> None:
    p = PluginProblem(info.dist, info.name, stage, message)
    st.problems.append(p)
    log.warning("luce: %s", p)


def _short(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0][:300] if text else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _build() -> _State:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    st = _State(pm)

    from . import builtin
    info = PluginInfo(BUILTIN, BUILTIN, _luce_version(), "luce.plugins.builtin", builtin=True, pm_name=BUILTIN)
    pm.register(builtin, name=BUILTIN)
    info.loaded = True
    st.plugins.append(info)

    for ep, dist, version in _entry_points():
        if ep.value == "luce.plugins.builtin":  # luce's own, already registered above
            continue
        if not _selected(ep.name, dist):
            continue
        info = PluginInfo(ep.name, dist, version, ep.value, pm_name=f"{dist}:{ep.name}")
        st.plugins.append(info)
        try:
            obj = ep.load()
        except Exception as e:
            _problem(st, info, "import", f"could not import {ep.value!r}: {_short(e)}")
            continue
        try:
            pm.register(obj, name=info.pm_name)
        except Exception as e:  # pluggy.PluginValidationError: a hookimpl that doesn't fit its spec
            _problem(st, info, "register", _short(e))
            continue
        callers = pm.get_hookcallers(obj) or []
        unknown = sorted(c.name for c in callers if c.spec is None)
        if unknown:
            _problem(st, info, "register", f"unknown hook(s) {', '.join(unknown)} (luce's hooks: "
                                           f"{', '.join(_hook_names())})")
        if len(unknown) == len(callers):
            if not callers:
                _problem(st, info, "register", f"{ep.value!r} implements no luce hook (mark functions with "
                                               "luce.plugins.hookimpl and name them after the hooks)")
            pm.unregister(obj)
            continue
        info.loaded = True

    _call_families(st)
    _call_kernels(st)
    return st


def _hook_names() -> list[str]:
    return sorted(n for n in dir(hookspecs) if n.startswith("register_"))


def _impls(st: _State, hook: str):
    """(PluginInfo, HookImpl) for each plugin implementing `hook`, in load order."""
    by_pm = {impl.plugin_name: impl for impl in getattr(st.pm.hook, hook).get_hookimpls()}
    for info in st.plugins:
        if info.loaded and info.pm_name in by_pm:
            yield info, by_pm[info.pm_name]


def _call(impl, **kwargs):
    return impl.function(**{a: kwargs[a] for a in impl.argnames})


def _call_families(st: _State) -> None:
    from ..models.family import FamilyDeclarationError, ModelFamily

    for info, impl in _impls(st, "register_model_families"):
        def register(family, override: bool = False, _info=info):
            if not isinstance(family, ModelFamily):
                _problem(st, _info, "register_model_families",
                         f"register() takes a luce.models.family.ModelFamily, got {type(family).__name__}")
                return None
            try:
                fam = family.validate()
            except FamilyDeclarationError as e:
                _problem(st, _info, "register_model_families", str(e))
                return None
            fam = dataclasses.replace(fam, plugin=_info.dist)
            prev = st.by_name.get(fam.name)
            if prev is not None:
                _problem(st, _info, "register_model_families",
                         f"family {fam.name!r}: field 'name': already registered by {prev.plugin!r}")
                return None
            taken = [(a, st.arch_map[a]) for a in fam.architectures if a in st.arch_map]
            if taken and not override:
                a, other = taken[0]
                _problem(st, _info, "register_model_families",
                         f"family {fam.name!r}: field 'architectures': {a!r} is already handled by family "
                         f"{other.name!r} from {other.plugin!r} (register(family, override=True) replaces it)")
                return None
            for a, other in taken:
                st.overridden[a] = other
                st.notes.append(f"architecture {a!r}: family {fam.name!r} from {fam.plugin!r} overrides "
                                f"{other.name!r} from {other.plugin!r}")
            st.by_name[fam.name] = fam
            for a in fam.architectures:
                st.arch_map[a] = fam
            return fam

        try:
            _call(impl, register=register)
        except Exception as e:
            _problem(st, info, "register_model_families", _short(e))


def _call_kernels(st: _State) -> None:
    from ..models.family import ModelFamily

    for info, hook_impl in _impls(st, "register_kernels"):
        def register(family, op, impl, backend: str = "*", _info=info):
            fam = family.name if isinstance(family, ModelFamily) else family
            stage = "register_kernels"
            if fam != "*" and fam not in st.by_name:
                _problem(st, _info, stage, f"kernel {op!r}: unknown family {fam!r} (registered: "
                                           f"{', '.join(sorted(st.by_name))}, or '*')")
                return
            if not isinstance(op, str) or not op.isidentifier():
                _problem(st, _info, stage, f"kernel op must be an identifier, got {op!r}")
                return
            if not callable(impl):
                _problem(st, _info, stage, f"kernel {op!r} for {fam!r}: implementation is not callable")
                return
            if backend not in BACKENDS:
                _problem(st, _info, stage, f"kernel {op!r}: backend must be one of {', '.join(BACKENDS)}, "
                                           f"got {backend!r}")
                return
            entries = st.kernel_table.setdefault((fam, op, backend), [])
            if entries and not entries[-1][0].builtin and entries[-1][0] is not _info:
                st.notes.append(f"kernel {op!r} for {fam!r} on {backend!r}: {_info.label} overrides "
                                f"{entries[-1][0].label}")
            entries.append((_info, impl))

        try:
            _call(hook_impl, register=register)
        except Exception as e:
            _problem(st, info, "register_kernels", _short(e))


def _state() -> _State:
    global _state_obj
    st = _state_obj
    if st is None:
        with _lock:
            if _state_obj is None:
                _state_obj = _build()
            st = _state_obj
    return st


def reset() -> None:
    """Forget everything loaded, so that the next call loads plugins again (after
    installing one, or changing LUCE_PLUGINS). Commands already added to a CLI stay."""
    global _state_obj
    with _lock:
        _state_obj = None
    importlib.invalidate_caches()


# -- queries -------------------------------------------------------------------------

def plugin_manager() -> pluggy.PluginManager:
    return _state().pm


def families() -> dict[str, Any]:
    """architecture name -> ModelFamily"""
    return dict(_state().arch_map)


def family_list() -> list:
    """Every registered family, in registration order."""
    return list(_state().by_name.values())


def plugins() -> list[PluginInfo]:
    return list(_state().plugins)


def problems() -> list[PluginProblem]:
    return list(_state().problems)


def family_for(path, arch: str):
    """The family that loads `arch`, or UnknownArchitectureError listing the known ones."""
    st = _state()
    if arch in st.arch_map:
        return st.arch_map[arch]
    msg = (f"unsupported architecture {arch!r} (known: {', '.join(sorted(st.arch_map))}); "
           f"a plugin can add it: see {DOCS}")
    if st.problems:
        msg += "; plugins that failed: " + ", ".join(sorted({p.plugin for p in st.problems}))
    raise UnknownArchitectureError(path, msg)


# -- kernels -------------------------------------------------------------------------

def _family_name(family) -> str:
    """A family name from a ModelFamily, a name, a ModelConfig (by its arch) or None ("*")."""
    if family is None:
        return "*"
    if isinstance(family, str):
        return family
    if hasattr(family, "arch") and not hasattr(family, "name"):  # a ModelConfig
        fam = _state().arch_map.get(family.arch)
        return fam.name if fam is not None else "*"
    return family.name


def kernel_entry(family, op: str, backend: str = "*") -> tuple[PluginInfo, Callable] | None:
    """(plugin, implementation) that `kernels` would return."""
    st = _state()
    fam = _family_name(family)
    keys = [(fam, op, backend), (fam, op, "*"), ("*", op, backend), ("*", op, "*")]
    for key in dict.fromkeys(keys):
        entries = st.kernel_table.get(key)
        if entries:
            return entries[-1]
    return None


def kernels(family, op: str, backend: str = "*") -> Callable | None:
    """The kernel for `op` (an op name of the forward's op interface) for `family` (a
    ModelFamily, its name, or a ModelConfig) on `backend` ("cpu", "cuda" or "*"), or None when no
    plugin registered one (the backend then uses its own).

    Precedence: (family, backend) > (family, any backend) > (any family, backend) > (any
    family, any backend); at one level, a third-party plugin beats luce's built-in and a
    later-loaded plugin beats an earlier one."""
    e = kernel_entry(family, op, backend)
    return e[1] if e else None


def kernel_entries() -> dict[tuple[str, str, str], list[tuple[str, Callable]]]:
    """(family, op, backend) -> [(distribution, implementation)], later ones win."""
    return {k: [(i.dist, f) for i, f in v] for k, v in _state().kernel_table.items()}


class _OverriddenOps:
    """`base` (an op interface: a class of static ops, or an instance) with `overrides`
    swapped in. An instance's own methods run bound to this view, so the ops they call
    (linears calling linear) reach the overrides too; every other attribute, read or
    written, is the instance's own, since a backend keeps per-forward state on it (the CUDA
    backend's arena, set after this view is made)."""

    def __init__(self, base, overrides: dict[str, Callable]):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name):
        if name in self._overrides:
            return self._overrides[name]
        base = self._base
        if not isinstance(base, type):
            raw = inspect.getattr_static(type(base), name, None)
            if inspect.isfunction(raw):  # a method: bound to the view, not the instance
                return types.MethodType(raw, self)
        return getattr(base, name)

    def __setattr__(self, name, value):
        setattr(self._base, name, value)


def ops_with_overrides(base_ops, family, backend: str):
    """`base_ops` (a backend's op interface) with the ops that third-party plugins
    registered for `family` on `backend` swapped in; `base_ops` itself when none."""
    st = _state()
    fam = _family_name(family)
    ops = {op for (f, op, b) in st.kernel_table if f in (fam, "*") and b in (backend, "*")}
    overrides = {}
    for op in ops:
        e = kernel_entry(fam, op, backend)
        if e and not e[0].builtin:
            overrides[op] = e[1]
    if not overrides:
        return base_ops
    if ("rms_norm" in overrides or "rope" in overrides) and "qk_rope" not in overrides:
        from ..kernels.qk_rope import qk_rope_from  # the fused op would bypass them
        overrides["qk_rope"] = qk_rope_from(overrides.get("rms_norm") or getattr(base_ops, "rms_norm"),
                                            overrides.get("rope") or getattr(base_ops, "rope"))
    if "linear" in overrides and "linears" not in overrides:  # the grouped op would bypass it
        lin = overrides["linear"]
        overrides["linears"] = lambda x, ws, biases: [lin(x, w, b) for w, b in zip(ws, biases)]
    return _OverriddenOps(base_ops, overrides)


# -- commands ------------------------------------------------------------------------

def register_commands(cli) -> None:
    """Let every plugin add commands to `cli` (a click.Group); idempotent per group."""
    st = _state()
    with _lock:
        if id(cli) in st.commands_done:
            return
        st.commands_done.add(id(cli))
    # luce's own commands: those the group had before any plugin added one
    core = getattr(cli, "_luce_core_commands", None)
    if core is None:
        core = cli._luce_core_commands = dict(cli.commands)
    for info, impl in _impls(st, "register_commands"):
        try:
            _call(impl, cli=cli)
        except Exception as e:
            _problem(st, info, "register_commands", _short(e))
        for name, cmd in core.items():
            if cli.commands.get(name) is not cmd:
                cli.commands[name] = cmd
                if not info.builtin:
                    _problem(st, info, "register_commands", f"may not replace luce's command {name!r}")


# -- `luce families` -----------------------------------------------------------------

def _family_record(fam, st: _State) -> dict:
    archs = [a for a in fam.architectures if st.arch_map.get(a) is fam]
    dist_version = next((p.version for p in st.plugins if p.dist == fam.plugin), "?")
    return {
        "name": fam.name,
        "plugin": fam.plugin,
        "version": dist_version,
        "description": fam.description,
        "architectures": archs,
        "overridden_architectures": [a for a in fam.architectures if a not in archs],
        "drafts": [{"kind": d.kind, "name": d.label, "targets": list(d.targets), "description": d.description}
                   for d in fam.drafts],
        "optimizations": {k: list(v) if isinstance(v, tuple) else v for k, v in fam.optimizations.items()},
        "sampling_defaults": {k: list(v) if isinstance(v, tuple) else v for k, v in fam.sampling_defaults.items()},
        "chat_format": {"tool_call_format": fam.chat_format.tool_call_format,
                        "reasoning": fam.chat_format.reasoning,
                        "reasoning_markers": list(fam.chat_format.reasoning_markers)},
        "kernels": sorted({f"{op}@{b}" for (f, op, b), v in st.kernel_table.items()
                           if f == fam.name and v}),
    }


def families_report(as_json: bool = False) -> str:
    """What `luce families` prints."""
    st = _state()
    recs = [_family_record(f, st) for f in st.by_name.values()]
    if as_json:
        return json.dumps({
            "families": recs,
            "plugins": [{"name": p.name, "dist": p.dist, "version": p.version, "value": p.value,
                         "builtin": p.builtin, "loaded": p.loaded} for p in st.plugins],
            "problems": [{"plugin": p.plugin, "entry_point": p.entry_point, "stage": p.stage,
                          "message": p.message} for p in st.problems],
            "notes": list(st.notes),
        }, indent=2)
    lines = []
    for r in recs:
        head = f"{r['name']}  (from {r['plugin']} {r['version']})"
        lines.append(head)
        if r["description"]:
            lines.append(f"  {r['description']}")
        archs = ", ".join(r["architectures"]) or "-"
        if r["overridden_architectures"]:
            archs += f"  [overridden: {', '.join(r['overridden_architectures'])}]"
        lines.append(f"  architectures: {archs}")
        drafts = []
        for d in r["drafts"]:
            s = d["kind"] if d["kind"] != "model" else f"model {d['name']}"
            if d["targets"]:
                s += f" -> {', '.join(d['targets'])}"
            drafts.append(s)
        lines.append(f"  drafts:        {'; '.join(drafts) or '-'}")
        opts = []
        for k, v in r["optimizations"].items():
            opts.append(f"{k}={','.join(v) if isinstance(v, list) else v}")
        lines.append(f"  optimizations: {', '.join(opts)}")
        cf = r["chat_format"]
        lines.append(f"  chat:          tool calls {cf['tool_call_format']}, reasoning "
                     f"{'/'.join(cf['reasoning_markers']) if cf['reasoning'] else 'no'}")
        if r["sampling_defaults"]:
            lines.append("  sampling:      " + ", ".join(f"{k}={v}" for k, v in r["sampling_defaults"].items()))
        if r["kernels"]:
            lines.append(f"  kernels:       {', '.join(r['kernels'])}")
    if st.notes:
        lines.append("")
        lines += [f"note: {n}" for n in st.notes]
    if st.problems:
        lines.append("")
        lines.append(f"problems ({len(st.problems)}; see {DOCS}):")
        lines += [f"  {p}" for p in st.problems]
    return "\n".join(lines)
