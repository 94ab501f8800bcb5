"""Plugin manager: loads the built-in families and the `luce` entry-point group."""
from __future__ import annotations

import pluggy

from ..errors import UnknownArchitectureError
from . import hookspecs

_pm: pluggy.PluginManager | None = None
_families: dict[str, object] | None = None


def plugin_manager() -> pluggy.PluginManager:
    global _pm
    if _pm is None:
        pm = pluggy.PluginManager("luce")
        pm.add_hookspecs(hookspecs)
        from . import builtin
        pm.register(builtin, name="luce.builtin")
        pm.load_setuptools_entrypoints("luce")
        _pm = pm
    return _pm


def families() -> dict[str, object]:
    """architecture name -> ModelFamily"""
    global _families
    if _families is None:
        found: dict[str, object] = {}
        def register(fam):
            for arch in fam.architectures:
                found[arch] = fam
        plugin_manager().hook.register_model_families(register=register)
        _families = found
    return _families


def family_for(path, arch: str):
    fams = families()
    if arch not in fams:
        raise UnknownArchitectureError(
            path, f"unsupported architecture {arch!r} (known: {', '.join(sorted(fams))}; "
                  "see docs/plugins.md to add one)")
    return fams[arch]
