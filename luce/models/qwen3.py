"""Qwen3: RMSNorm on each q and k head before rotation; no projection bias."""
from ..gguf_file import GGUFFile
from .config import ROPE_HALVES, read_config
from .family import ChatFormat, DraftModel, DraftSpec, ModelFamily, Optimizations, find_local_gguf


def qwen3_config(f: GGUFFile):
    return read_config(f, rope_style=ROPE_HALVES, qk_norm=True)


def _qwen3(size: str) -> DraftModel:
    # Found on disk only (never downloaded at registration); resolved when first used.
    return DraftModel(f"Qwen3-{size}", find_local_gguf(f"qwen3-{size.lower()}*.gguf"),
                      hint=f"download one, e.g. `luce info Qwen/Qwen3-{size}-GGUF:Qwen3-{size}-Q8_0.gguf`, "
                           "or put a GGUF in $LUCE_DRAFT_DIR")


_LARGER_THAN_06B = ("qwen3-1.7b*", "qwen3-4b*", "qwen3-8b*", "qwen3-14b*", "qwen3-32b*")
_LARGER_THAN_17B = ("qwen3-8b*", "qwen3-14b*", "qwen3-32b*")

FAMILY = ModelFamily(
    name="qwen3",
    architectures=("qwen3",),
    description="Qwen3 dense models",
    read_config=qwen3_config,
    chat_format=ChatFormat(tool_call_format="hermes", reasoning=True),
    sampling_defaults={"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0},
    drafts=(
        DraftSpec(kind="model", model=_qwen3("0.6B"), name="Qwen3-0.6B", targets=_LARGER_THAN_06B,
                  description="Qwen3-0.6B drafts for Qwen3-1.7B and larger"),
        DraftSpec(kind="model", model=_qwen3("1.7B"), name="Qwen3-1.7B", targets=_LARGER_THAN_17B,
                  description="Qwen3-1.7B drafts for Qwen3-8B and larger"),
        DraftSpec(kind="lookup", name="prompt-lookup", description="prompt n-gram lookup"),
    ),
    optimizations=Optimizations(ddtree_budget=22, kv_types=("f16", "q8_0")),
)
