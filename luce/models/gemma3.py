"""Gemma 3: GeGLU FFN, embeddings scaled by sqrt(n_embd), an RMSNorm on each attention and
FFN output before its residual add, per-head q/k RMSNorm, and five sliding-window layers
(window 512, RoPE base 10,000) for every global one (RoPE base from the file). GGUFs store
Gemma's norm weights with its +1 already added, so the plain RMSNorm applies."""
import dataclasses
import math

from ..errors import LuceError
from ..gguf_file import ModelMetadata
from .config import ROPE_HALVES, read_config
from .family import ChatFormat, DraftSpec, ModelFamily, Optimizations

SWA_PATTERN = 6  # layers 5, 11, 17, ... attend globally (llama.cpp and transformers agree)
ROPE_BASE_SWA = 10_000.0  # not in the GGUF: Gemma 3's rope_local_base_freq


def gemma3_config(f: ModelMetadata):
    cfg = read_config(f, rope_style=ROPE_HALVES, qk_norm=True, post_norms=True, ffn_act="gelu_tanh",
                      swa_pattern=SWA_PATTERN, rope_base_swa=ROPE_BASE_SWA)
    cfg = dataclasses.replace(cfg, embed_scale=math.sqrt(cfg.n_embd))
    if cfg.n_layers == 62:
        # 27B scales attention by 1/sqrt(n_embd / n_heads), not 1/sqrt(head_dim) (llama.cpp)
        raise LuceError(f"{f.path}: Gemma 3 27B's attention scale is not supported yet")
    scaling = f.get(f"{cfg.arch}.rope.scaling.factor")
    if scaling not in (None, 1, 1.0):
        raise LuceError(f"{f.path}: RoPE scaling (factor {scaling}) is not supported for gemma3 yet")
    return cfg


FAMILY = ModelFamily(
    name="gemma3",
    architectures=("gemma3",),
    description="Gemma 3 text models (270M to 12B)",
    read_config=gemma3_config,
    chat_format=ChatFormat(tool_call_format="json"),
    sampling_defaults={"temperature": 1.0, "top_k": 64, "top_p": 0.95, "min_p": 0.0},
    drafts=(DraftSpec(kind="lookup", name="prompt-lookup", description="prompt n-gram lookup"),),
    optimizations=Optimizations(ddtree_budget=22, kv_types=("f16",)),
)
