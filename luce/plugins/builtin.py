"""luce's own plugin: the built-in families (llama, qwen2, qwen3, gemma3) and the CPU reference
kernels, registered through the same hooks as a third-party plugin's."""
from .hookspecs import hookimpl

# the op interface of luce.models.transformer.forward
OPS = ("embed", "rms_norm", "linear", "split_heads", "merge_heads", "rope", "qk_rope", "attention", "swiglu",
       "take_rows", "scale", "add")


@hookimpl
def register_model_families(register):
    from ..models import gemma3, llama, qwen2, qwen3
    for fam in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma3.FAMILY):
        register(fam)


@hookimpl
def register_kernels(register):
    # The numpy references, for every family, on the CPU backend: the defaults that a
    # plugin's registration for its family (or for "cuda") takes precedence over.
    from ..backends.cpu import NumpyOps
    for op in OPS:
        register("*", op, getattr(NumpyOps, op), backend="cpu")
