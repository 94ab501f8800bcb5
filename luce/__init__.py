"""luce: local LLM inference for GGUF models on NVIDIA GPUs (and a numpy CPU backend)."""
__version__ = "0.1.0"

from .errors import LuceError, ModelFileError  # noqa: E402
from .model import Model, load  # noqa: E402

__all__ = ["load", "Model", "LuceError", "ModelFileError", "__version__"]
