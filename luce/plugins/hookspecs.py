"""luce's hook specifications: the public API of plugins (namespace "luce")."""
import pluggy

hookspec = pluggy.HookspecMarker("luce")
hookimpl = pluggy.HookimplMarker("luce")


@hookspec
def register_model_families(register):
    """Call register(ModelFamily) for each family the plugin provides."""
