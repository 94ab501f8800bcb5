"""luce: local LLM inference for GGUF models on NVIDIA GPUs (and a numpy CPU backend)."""
__version__ = "0.1.0"

from .errors import LuceError, ModelFileError  # noqa: E402

__all__ = ["load", "Model", "LuceError", "ModelFileError", "__version__"]


def __getattr__(name):
    # the model stack imports numba and friends: only pay for it when it is used
    if name in ("load", "Model"):
        from . import model
        return getattr(model, name)
    raise AttributeError(f"module 'luce' has no attribute {name!r}")
