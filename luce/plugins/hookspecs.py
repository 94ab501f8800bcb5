"""luce's hook specifications: the public API of plugins (pluggy project name "luce").

A plugin is a module (or object) with functions marked `@hookimpl`, advertised in the
`luce` entry-point group of its distribution:

    [project.entry-points.luce]
    mything = "luce_mything"

The built-in llama, qwen2 and qwen3 families are registered by `luce.plugins.builtin`
through these same hooks. Hook names and argument names are stable API: a plugin may
implement any subset of them, and may accept fewer arguments than a hook passes.
See docs/plugins.md.
"""
import pluggy

PROJECT = "luce"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_model_families(register):
    """Register model families.

    Call `register(family, override=False)` once for each `luce.models.family.ModelFamily`
    the plugin provides. The family is validated at registration; an invalid one is
    rejected with an error naming the plugin, the family and the field, and the plugin's
    other families still register. `family.plugin` is filled in by luce with the
    plugin's distribution name. A family may claim an architecture another plugin
    already handles only with `override=True` (the override is shown by `luce families`).
    """


@hookspec
def register_kernels(register):
    """Add or override kernels.

    Call `register(family, op, impl, backend="*")`: `family` is a family name (or "*"
    for every family), `op` the name of an operation of the op interface that
    `luce.models.transformer.forward` calls (`embed`, `rms_norm`, `linear`, `rope`,
    `qk_rope` (q and k: per-head norm, then `rope`; a plugin overriding `rms_norm` or
    `rope` gets `qk_rope` built from them), `attention`, `swiglu`, `split_heads`,
    `merge_heads`, `take_rows`, or a new op your own family's forward calls), `impl` a callable with that op's signature, and
    `backend` "cpu", "cuda" or "*". Backends look kernels up with
    `luce.plugins.kernels(family, op, backend)`: a family-specific registration beats a
    "*" one, a backend-specific one beats a "*" one, and a third-party plugin's beats
    luce's own. Called after every plugin's families are registered.
    """


@hookspec
def register_commands(cli):
    """Add command-line commands.

    `cli` is luce's `click.Group`: use `@cli.command()` or `cli.add_command(cmd)`. A
    plugin may not replace one of luce's own commands (it is kept, and the attempt is
    reported by `luce families`).
    """
