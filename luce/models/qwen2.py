"""Qwen2 / Qwen2.5: q/k/v projections carry a bias; NEOX (halves) rotation."""
from ..gguf_file import GGUFFile
from .config import ROPE_HALVES, read_config
from .family import ChatFormat, DraftSpec, ModelFamily


def qwen2_config(f: GGUFFile):
    return read_config(f, rope_style=ROPE_HALVES, qkv_bias=True)


FAMILY = ModelFamily(
    name="qwen2",
    architectures=("qwen2",),
    read_config=qwen2_config,
    chat_format=ChatFormat(tool_call_format="hermes"),
    drafts=(
        DraftSpec(kind="model", model="qwen2.5-coder-0.5b",
                  description="Qwen2.5-Coder-0.5B drafts for the 1.5B and larger Qwen2.5-Coder models"),
        DraftSpec(kind="lookup", description="prompt n-gram lookup"),
    ),
    optimizations={"ddtree_budget": 22, "kv_types": ("f16", "q8_0")},
)
