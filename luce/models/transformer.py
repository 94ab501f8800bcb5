"""The decoder-only transformer forward shared by the llama, qwen2, qwen3 and gemma3 families.

Written once against a backend's op interface (`ops`), so the CPU reference and the
CUDA backend run the same code. One signature serves prefill (a chain of tokens),
decode (one token) and speculative tree verification (N tokens whose attention mask
says which of the new tokens each one sees): see `forward`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..gguf_file import GGUFFile
from .config import ModelConfig


@dataclass
class LayerWeights:
    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    ffn_norm: Any
    w_gate: Any
    w_up: Any
    w_down: Any
    bq: Any = None
    bk: Any = None
    bv: Any = None
    q_norm: Any = None
    k_norm: Any = None
    post_attn_norm: Any = None
    post_ffn_norm: Any = None


@dataclass
class Weights:
    tok_embd: Any
    layers: list[LayerWeights]
    out_norm: Any
    output: Any  # the token embedding itself when the head is tied


def tensor_names(cfg: ModelConfig) -> list[str]:
    """Every tensor the forward reads, in load order."""
    names = ["token_embd.weight"]
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        names += [p + n for n in ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                                  "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight",
                                  "ffn_up.weight", "ffn_down.weight")]
        if cfg.qkv_bias:
            names += [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"]
        if cfg.qk_norm:
            names += [p + "attn_q_norm.weight", p + "attn_k_norm.weight"]
        if cfg.post_norms:
            names += [p + "post_attention_norm.weight", p + "post_ffw_norm.weight"]
    names.append("output_norm.weight")
    if not cfg.tied_output:
        names.append("output.weight")
    return names


def build_weights(cfg: ModelConfig, f: GGUFFile, load) -> Weights:
    """Assemble Weights, calling `load(TensorInfo)` for each tensor (the backend decides
    whether that dequantizes, uploads or keeps the memory map)."""
    for name in tensor_names(cfg):
        f.tensor(name)  # a missing tensor fails before anything is loaded
    t = lambda name: load(f.tensors[name])
    opt = lambda name: load(f.tensors[name]) if name in f.tensors else None
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=t(p + "attn_norm.weight"), wq=t(p + "attn_q.weight"), wk=t(p + "attn_k.weight"),
            wv=t(p + "attn_v.weight"), wo=t(p + "attn_output.weight"), ffn_norm=t(p + "ffn_norm.weight"),
            w_gate=t(p + "ffn_gate.weight"), w_up=t(p + "ffn_up.weight"), w_down=t(p + "ffn_down.weight"),
            bq=opt(p + "attn_q.bias"), bk=opt(p + "attn_k.bias"), bv=opt(p + "attn_v.bias"),
            q_norm=opt(p + "attn_q_norm.weight"), k_norm=opt(p + "attn_k_norm.weight"),
            post_attn_norm=opt(p + "post_attention_norm.weight"), post_ffn_norm=opt(p + "post_ffw_norm.weight"),
        ))
    tok = t("token_embd.weight")
    return Weights(tok_embd=tok, layers=layers, out_norm=t("output_norm.weight"),
                   output=tok if cfg.tied_output else t("output.weight"))


def _post_norm_residual(ops, y, x, w_post, w_next, eps):
    """x += RMSNorm(y) w_post and the norm after it: (x, h). One op where the backend has it
    (a plugin backend without it gets the composed ops)."""
    op = getattr(ops, "post_norm_residual", None)
    if op is not None:
        return op(y, x, w_post, w_next, eps)
    x = ops.add(x, ops.rms_norm(y, w_post, eps))
    return x, ops.rms_norm(x, w_next, eps)


def forward(cfg: ModelConfig, w: Weights, ops, kv, tokens, positions, mask=None, logits_rows=None):
    """Run N new tokens through the model.

    tokens, positions: int arrays of length N. `mask[i, j]` (N x N bool) says whether
    new token i attends to new token j; None means causal (a chain). Every new token
    also sees all of the KV cache's committed rows. The new K/V rows are written after
    the committed ones; `kv.commit(accepted)` later keeps the accepted ones.
    `logits_rows` selects which rows need logits (prefill only needs the last).
    """
    eps = cfg.rms_eps
    x = ops.embed(w.tok_embd, tokens)
    if cfg.embed_scale != 1.0:
        x = ops.scale(x, cfg.embed_scale)
    h = None  # the next norm's output when the op before it made it (linear_norm)
    n_layers = len(w.layers)
    for li, lw in enumerate(w.layers):
        ops.new_layer()  # a layer's temporaries may reuse the previous layer's memory
        if h is None:
            h = ops.rms_norm(x, lw.attn_norm, eps)
        # one op for the three projections of h: a backend may run several in one launch
        q, k, v = ops.linears(h, (lw.wq, lw.wk, lw.wv), (lw.bq, lw.bk, lw.bv))
        q = ops.split_heads(q, cfg.n_heads, cfg.head_dim)
        k = ops.split_heads(k, cfg.n_kv_heads, cfg.head_dim)
        v = ops.split_heads(v, cfg.n_kv_heads, cfg.head_dim)
        # freq_scale only where positions are scaled: a plugin's qk_rope of the older signature still runs
        scaled = {} if cfg.layer_rope_scale(li) == 1.0 else {"freq_scale": cfg.layer_rope_scale(li)}
        q, k = ops.qk_rope(q, k, positions, lw.q_norm if cfg.qk_norm else None, lw.k_norm if cfg.qk_norm else None,
                           eps, cfg.rope_dim, cfg.layer_rope_base(li), cfg.rope_style, **scaled)
        if cfg.attn_scale is not None:  # attention scales by 1 / sqrt(head_dim) itself
            q = ops.scale(q, cfg.attn_scale * math.sqrt(cfg.head_dim))
        o = ops.attention(kv, li, q, k, v, positions, mask, cfg.layer_window(li))
        if cfg.post_norms:  # Gemma: the output normed before it joins the residual stream
            x, h = _post_norm_residual(ops, ops.linear(ops.merge_heads(o), lw.wo), x, lw.post_attn_norm,
                                       lw.ffn_norm, eps)
        else:
            # the residual update and the norm after it as one op: the CUDA backend's decode
            # leaves the norm's scaling to the products that read it (no launch of its own)
            x, h = ops.linear_norm(ops.merge_heads(o), lw.wo, x, lw.ffn_norm, eps)
        # act(h Wg) * (h Wu): SwiGLU in one fused pass on the GPU. SwiGLU is asked for without
        # `act`, so a plugin's gated_linear of the older signature still serves it
        g = ops.gated_linear(h, lw.w_gate, lw.w_up) if cfg.ffn_act == "silu" else \
            ops.gated_linear(h, lw.w_gate, lw.w_up, act=cfg.ffn_act)
        # and the next layer's norm (the output norm after the last)
        next_norm = w.layers[li + 1].attn_norm if li + 1 < n_layers else w.out_norm
        if cfg.post_norms:
            x, h = _post_norm_residual(ops, ops.linear(g, lw.w_down), x, lw.post_ffn_norm, next_norm, eps)
        else:
            x, h = ops.linear_norm(g, lw.w_down, x, next_norm, eps)
    if h is None:
        h = ops.rms_norm(x, w.out_norm, eps)
    if logits_rows is not None:  # norms are per row: taking the rows after the norm is the same
        h = ops.take_rows(h, logits_rows)
    return ops.linear(h, w.output)
