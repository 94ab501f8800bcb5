"""Gemma 3: GeGLU FFN, embeddings scaled by sqrt(n_embd), an RMSNorm on each attention and
FFN output before its residual add, per-head q/k RMSNorm, and five sliding-window layers
(window 512, RoPE base 10,000) for every global one (RoPE base and linear scaling from the
file). GGUFs store Gemma's norm weights with its +1 already added, so the plain RMSNorm
applies."""
import dataclasses
import math

from ..gguf_file import ModelMetadata
from .config import ROPE_HALVES, read_config
from .family import ChatFormat, DraftSpec, ModelFamily, Optimizations

SWA_PATTERN = 6  # layers 5, 11, 17, ... attend globally (llama.cpp and transformers agree)
ROPE_BASE_SWA = 10_000.0  # not in the GGUF: Gemma 3's rope_local_base_freq


def gemma3_config(f: ModelMetadata):
    cfg = read_config(f, rope_style=ROPE_HALVES, qk_norm=True, post_norms=True, ffn_act="gelu_tanh",
                      swa_pattern=SWA_PATTERN, rope_base_swa=ROPE_BASE_SWA)
    # 27B (62 layers) scales attention by 1/sqrt(n_embd / n_heads) (its query_pre_attn_scalar),
    # not 1/sqrt(head_dim); the GGUF does not say, llama.cpp goes by the layer count too
    attn_scale = 1.0 / math.sqrt(cfg.n_embd / cfg.n_heads) if cfg.n_layers == 62 else None
    # 4B to 27B scale positions linearly (factor 8) in the global layers: read_config's
    # rope_freq_scale, which layer_rope_scale leaves out of the windowed ones
    return dataclasses.replace(cfg, embed_scale=math.sqrt(cfg.n_embd), attn_scale=attn_scale)


FAMILY = ModelFamily(
    name="gemma3",
    architectures=("gemma3",),
    description="Gemma 3 text models (270M to 27B)",
    read_config=gemma3_config,
    chat_format=ChatFormat(tool_call_format="json"),
    sampling_defaults={"temperature": 1.0, "top_k": 64, "top_p": 0.95, "min_p": 0.0},
    drafts=(DraftSpec(kind="lookup", name="prompt-lookup", description="prompt n-gram lookup"),),
    optimizations=Optimizations(ddtree_budget=22, kv_types=("f16",)),
)
