"""The built-in families, registered through the same hook as third-party ones."""
from ..models import llama, qwen2, qwen3
from .hookspecs import hookimpl


@hookimpl
def register_model_families(register):
    for fam in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY):
        register(fam)
