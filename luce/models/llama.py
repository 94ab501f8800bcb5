"""Llama 3 and SmolLM2. Llama GGUFs store Q/K rows permuted for adjacent-pair rotation."""
from ..gguf_file import GGUFFile
from .config import ROPE_ADJACENT, read_config
from .family import ChatFormat, DraftSpec, ModelFamily, Optimizations


def llama_config(f: GGUFFile):
    return read_config(f, rope_style=ROPE_ADJACENT)


FAMILY = ModelFamily(
    name="llama",
    architectures=("llama",),
    description="Llama 3.x, SmolLM2 and other llama-architecture models",
    read_config=llama_config,
    chat_format=ChatFormat(tool_call_format="json"),
    drafts=(DraftSpec(kind="lookup", name="prompt-lookup", description="prompt n-gram lookup"),),
    optimizations=Optimizations(ddtree_budget=22, kv_types=("f16", "q8_0")),
)
