"""A model's shape and numerics, read from GGUF metadata.

One dataclass for every decoder-only family: families differ by flags (bias, q/k
norm, rope style), not by code paths.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..gguf_file import ModelFileError, ModelMetadata

ROPE_ADJACENT = "adjacent"  # GPT-J style: llama GGUFs store Q/K rows permuted for it
ROPE_HALVES = "halves"  # NEOX style: qwen2/qwen3 rotate the two halves of a head


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_style: str
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_output: bool = False
    sliding_window: int | None = None
    # Gemma-style numerics (defaults: none of it)
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(n_embd))
    post_norms: bool = False  # RMSNorm on the attention and FFN outputs before their residual add
    ffn_act: str = "silu"  # the FFN gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    swa_pattern: int = 0  # with sliding_window: every swa_pattern-th layer is global (0: none is)
    rope_base_swa: float | None = None  # the windowed layers' RoPE base (None: rope_base)
    # linear RoPE scaling: positions times this (1 / rope.scaling.factor) in the layers that
    # take rope_base (Gemma 3's windowed layers with their own base are not scaled)
    rope_freq_scale: float = 1.0
    attn_scale: float | None = None  # attention logits' scale (None: 1 / sqrt(head_dim))

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (None: it attends to the whole context)."""
        if self.sliding_window is None or self.swa_pattern and (i + 1) % self.swa_pattern == 0:
            return None
        return self.sliding_window

    def _swa_rope(self, i: int) -> bool:
        return self.rope_base_swa is not None and self.layer_window(i) is not None

    def layer_rope_base(self, i: int) -> float:
        return self.rope_base_swa if self._swa_rope(i) else self.rope_base

    def layer_rope_scale(self, i: int) -> float:
        return 1.0 if self._swa_rope(i) else self.rope_freq_scale

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def read_config(f: ModelMetadata, *, rope_style: str, qkv_bias: bool = False, qk_norm: bool = False,
                **extra) -> ModelConfig:
    """Read the `{arch}.*` keys every llama-like GGUF carries; `extra`: other ModelConfig
    fields (a family's numerics)."""
    a = f.architecture
    n_embd = f.get_int(f"{a}.embedding_length")
    n_heads = f.get_int(f"{a}.attention.head_count")
    n_kv = f.get_int(f"{a}.attention.head_count_kv", n_heads)
    head_dim = f.get_int(f"{a}.attention.key_length", n_embd // n_heads)
    if "token_embd.weight" not in f.tensors:
        f.tensor("token_embd.weight")  # raises the model-file error
    extra.setdefault("rope_freq_scale", rope_freq_scale(f))
    vocab = f.tensors["token_embd.weight"].shape[0]
    return ModelConfig(
        arch=a,
        n_layers=f.get_int(f"{a}.block_count"),
        n_embd=n_embd,
        n_ff=f.get_int(f"{a}.feed_forward_length"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=vocab,
        n_ctx_train=f.get_int(f"{a}.context_length", 4096),
        rms_eps=f.get_float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_base=f.get_float(f"{a}.rope.freq_base", 10000.0),
        rope_dim=f.get_int(f"{a}.rope.dimension_count", head_dim),
        rope_style=rope_style,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        tied_output="output.weight" not in f.tensors,
        sliding_window=(f.get_int(f"{a}.attention.sliding_window") if f"{a}.attention.sliding_window" in f.metadata else None),
        **extra,
    )


def rope_freq_scale(f: ModelMetadata) -> float:
    """1 / the factor of linear RoPE scaling (`{arch}.rope.scaling.type` "linear", or an old
    file's `rope.scale_linear`), as llama.cpp reads it; 1 without one. Other scaling types
    (YaRN, Llama 3's per-frequency factors) are not applied here."""
    a = f.architecture
    kind = f.get_str(f"{a}.rope.scaling.type")
    factor = f.get_float(f"{a}.rope.scaling.factor", 0.0)
    if kind is None and not factor:
        factor, kind = f.get_float(f"{a}.rope.scale_linear", 0.0), "linear"
    if kind != "linear" or factor in (0.0, 1.0):
        return 1.0
    if factor < 0:
        raise ModelFileError(f.path, f"metadata {a}.rope.scaling.factor should be positive, got {factor}")
    return 1.0 / factor
