"""Qwen3: RMSNorm on each q and k head before rotation; no projection bias."""
from ..gguf_file import GGUFFile
from .config import ROPE_HALVES, read_config
from .family import ChatFormat, DraftSpec, ModelFamily


def qwen3_config(f: GGUFFile):
    return read_config(f, rope_style=ROPE_HALVES, qk_norm=True)


FAMILY = ModelFamily(
    name="qwen3",
    architectures=("qwen3",),
    read_config=qwen3_config,
    chat_format=ChatFormat(tool_call_format="hermes", reasoning=True),
    sampling_defaults={"temperature": 0.6, "top_p": 0.95, "top_k": 20},
    drafts=(
        DraftSpec(kind="model", model="qwen3-0.6b", description="Qwen3-0.6B drafts for larger Qwen3 models"),
        DraftSpec(kind="lookup", description="prompt n-gram lookup"),
    ),
    optimizations={"ddtree_budget": 22, "kv_types": ("f16", "q8_0")},
)
