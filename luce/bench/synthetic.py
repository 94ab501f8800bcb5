"""Random-weight models with real models' shapes and tensor types.

Benchmark-size models cannot be downloaded onto the GPU machine; decode speed does not
depend on weight values, so we make them there. Quantized blocks are random bytes with
their f16 scale fields overwritten by small finite values, so every weight dequantizes
to a finite number. `write_gguf` writes a real GGUF with gguf-py (tests also use it for
tiny models of any family).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..gguf_file import ModelMetadata

Q = None  # gguf.GGMLQuantizationType, imported lazily to keep `luce --help` fast


def _q():
    global Q
    if Q is None:
        import gguf
        Q = gguf.GGMLQuantizationType
    return Q


@dataclass(frozen=True)
class ModelShape:
    arch: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_output: bool = False
    n_ctx_train: int = 40960
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    sliding_window: int | None = None
    rope_scaling: float = 0.0  # linear RoPE scaling's factor (0: none)

    def tensor_shapes(self) -> dict[str, tuple[int, int] | tuple[int]]:
        """name -> numpy shape (rows, cols) of every tensor the family reads."""
        d, hd = self.n_embd, self.head_dim
        out: dict = {"token_embd.weight": (self.vocab_size, d)}
        for i in range(self.n_layers):
            p = f"blk.{i}."
            out.update({
                p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,),
                p + "attn_q.weight": (self.n_heads * hd, d), p + "attn_k.weight": (self.n_kv_heads * hd, d),
                p + "attn_v.weight": (self.n_kv_heads * hd, d), p + "attn_output.weight": (d, self.n_heads * hd),
                p + "ffn_gate.weight": (self.n_ff, d), p + "ffn_up.weight": (self.n_ff, d),
                p + "ffn_down.weight": (d, self.n_ff),
            })
            if self.arch in ("qwen3", "gemma3"):
                out[p + "attn_q_norm.weight"] = (hd,)
                out[p + "attn_k_norm.weight"] = (hd,)
            if self.arch == "gemma3":
                out[p + "post_attention_norm.weight"] = (d,)
                out[p + "post_ffw_norm.weight"] = (d,)
            if self.arch == "qwen2":
                out[p + "attn_q.bias"] = (self.n_heads * hd,)
                out[p + "attn_k.bias"] = (self.n_kv_heads * hd,)
                out[p + "attn_v.bias"] = (self.n_kv_heads * hd,)
        out["output_norm.weight"] = (d,)
        if not self.tied_output:
            out["output.weight"] = (self.vocab_size, d)
        return out


SHAPES: dict[str, ModelShape] = {
    "qwen3-0.6b": ModelShape("qwen3", 28, 1024, 3072, 16, 8, 128, 151936, tied_output=True),
    "qwen3-8b": ModelShape("qwen3", 36, 4096, 12288, 32, 8, 128, 151936),
    "qwen3-32b": ModelShape("qwen3", 64, 5120, 25600, 64, 8, 128, 151936),
    "llama-3-8b": ModelShape("llama", 32, 4096, 14336, 32, 8, 128, 128256, n_ctx_train=8192, rope_base=500000.0,
                             rms_eps=1e-5),
    "gemma3-270m": ModelShape("gemma3", 18, 640, 2048, 4, 1, 256, 262144, tied_output=True, n_ctx_train=32768,
                              sliding_window=512),
    "gemma3-4b": ModelShape("gemma3", 34, 2560, 10240, 8, 4, 256, 262208, tied_output=True, n_ctx_train=131072,
                            sliding_window=1024, rope_scaling=8.0),
    "gemma3-27b": ModelShape("gemma3", 62, 5376, 21504, 32, 16, 128, 262208, tied_output=True, n_ctx_train=131072,
                             sliding_window=1024, rope_scaling=8.0),
}


def q4_k_m_type(name: str):
    """The tensor types of a Q4_K_M file (simplified: every attn_v/ffn_down in Q6_K)."""
    Qt = _q()
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return Qt.F32
    if name == "output.weight" or name.endswith("attn_v.weight") or name.endswith("ffn_down.weight"):
        return Qt.Q6_K
    return Qt.Q4_K


def fit_type(qtype, n_cols: int):
    """qtype, or what llama.cpp's quantizer takes instead where a row is not a whole number
    of 256-wide K-quant blocks (Gemma-3-270M's 640: Q4_K -> Q5_0, Q6_K -> Q8_0)."""
    import gguf
    if n_cols % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    Qt = _q()
    return {Qt.Q4_K: Qt.Q5_0, Qt.Q5_K: Qt.Q5_1, Qt.Q6_K: Qt.Q8_0}.get(qtype, qtype)


# byte offsets of the f16 scale fields inside one block of each quantized type
_F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def random_quant_rows(qtype, n_rows: int, n_cols: int, rng: np.random.Generator, scale: float = 0.002) -> np.ndarray:
    """uint8 [n_rows, row_bytes]: random blocks whose scales are small and finite."""
    import gguf
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if n_cols % block:
        raise ValueError(f"{n_cols} columns is not a multiple of {qtype.name}'s block of {block}")
    nb = n_rows * n_cols // block
    raw = rng.integers(0, 256, size=(nb, type_size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype.name]:
        s = (rng.random(nb, dtype=np.float32) * scale + scale / 4).astype(np.float16)
        raw[:, off:off + 2] = s.view(np.uint8).reshape(nb, 2)
    return raw.reshape(n_rows, -1)


def random_tensor(name: str, shape, qtype, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """A tensor as the bytes (or floats) a GGUF stores for it."""
    Qt = _q()
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if qtype == Qt.F32:
        return (std * rng.standard_normal(shape)).astype(np.float32)
    if qtype == Qt.F16:
        return (std * rng.standard_normal(shape)).astype(np.float16)
    if qtype.name in _F16_FIELDS and qtype.name.endswith("_K"):
        return random_quant_rows(qtype, shape[0], shape[1], rng)
    from gguf import quants
    return quants.quantize((std * rng.standard_normal(shape)).astype(np.float32), qtype)


def shape_metadata(shape: ModelShape) -> dict:
    """The `{arch}.*` metadata of a model of this shape (what write_gguf writes)."""
    a = shape.arch
    md = {"general.architecture": a, f"{a}.block_count": shape.n_layers, f"{a}.context_length": shape.n_ctx_train,
          f"{a}.embedding_length": shape.n_embd, f"{a}.feed_forward_length": shape.n_ff,
          f"{a}.attention.head_count": shape.n_heads, f"{a}.attention.head_count_kv": shape.n_kv_heads,
          f"{a}.attention.key_length": shape.head_dim, f"{a}.attention.value_length": shape.head_dim,
          f"{a}.attention.layer_norm_rms_epsilon": shape.rms_eps, f"{a}.rope.freq_base": shape.rope_base}
    if shape.sliding_window is not None:
        md[f"{a}.attention.sliding_window"] = shape.sliding_window
    if shape.rope_scaling:
        md[f"{a}.rope.scaling.type"] = "linear"
        md[f"{a}.rope.scaling.factor"] = float(shape.rope_scaling)
    return md


def write_gguf(path, shape: ModelShape, *, types=None, seed: int = 0, tokenizer_from=None,
               tensors: dict | None = None) -> Path:
    """Write a random-weight model. `types(name) -> GGMLQuantizationType` picks each tensor's
    type (default Q4_K_M-like); `tokenizer_from` copies the tokenizer.* metadata of another
    GGUF so the model can tokenize; `tensors` overrides individual tensors with given arrays."""
    import gguf

    path = Path(path)
    types = types or q4_k_m_type
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), shape.arch)
    for key, v in shape_metadata(shape).items():
        if key != "general.architecture":  # the writer's own
            (w.add_string if isinstance(v, str) else w.add_float32 if isinstance(v, float) else w.add_uint32)(key, v)
    if tokenizer_from is not None:
        _copy_tokenizer(w, tokenizer_from)
    else:
        _byte_tokenizer(w, shape.vocab_size)
    for name, shp in shape.tensor_shapes().items():
        qtype = fit_type(types(name), shp[-1])
        arr = tensors[name] if tensors and name in tensors else random_tensor(name, shp, qtype, rng)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, np.ascontiguousarray(arr))
        else:
            w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# the smallest shape of the same family and vocabulary, as the draft of a --spec run
DRAFTS = {"qwen3-8b": "qwen3-0.6b", "qwen3-32b": "qwen3-0.6b"}


def byte_tokenizer_metadata(n_vocab: int) -> dict:
    """A byte-level BPE tokenizer (gpt2 model, no merges) of n_vocab >= 257 tokens as GGUF
    metadata: the 256 bytes, filler tokens, and an end-of-text token last, so that a
    random-weight model loads with luce.load and any text round-trips ({} below 257)."""
    from ..text.tokenizer import _bytes_to_unicode  # GPT-2's byte alphabet, as the tokenizer reads it
    if n_vocab < 257:
        return {}
    byte_char = _bytes_to_unicode()
    tokens = [byte_char[x] for x in range(256)] + [f"<|filler{i}|>" for i in range(n_vocab - 257)] + ["<|eot|>"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 256 + [3] * (n_vocab - 256),  # 3: control
            "tokenizer.ggml.merges": [], "tokenizer.ggml.eos_token_id": n_vocab - 1}


def _byte_tokenizer(w, n_vocab: int) -> None:
    md = byte_tokenizer_metadata(n_vocab)
    if not md:
        return
    w.add_tokenizer_model(md["tokenizer.ggml.model"])
    w.add_tokenizer_pre(md["tokenizer.ggml.pre"])
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])


def _copy_tokenizer(w, src) -> None:
    import gguf
    from gguf import GGUFValueType
    r = gguf.GGUFReader(str(src))
    for f in r.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        vtype = GGUFValueType(f.types[0])
        sub = GGUFValueType(f.types[1]) if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        w.add_key_value(f.name, f.contents(), vtype, sub)


def tiny(arch: str, vocab_size: int, **kw) -> ModelShape:
    """A few-layer model for tests."""
    base = ModelShape(arch, n_layers=2, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2, head_dim=16,
                      vocab_size=vocab_size, n_ctx_train=2048, rope_base=10000.0)
    return replace(base, **kw)


class SyntheticFile(ModelMetadata):
    """Stands in for a GGUFFile: metadata (a byte-level tokenizer's too), tensor names, types
    and shapes, no data. Its family reads its config as from a file; backends load its
    tensors with `synthetic_loader`; `luce.load("synthetic:NAME")` makes a Model of it."""

    def __init__(self, name: "str | ModelShape", types=None):
        from ..gguf_file import TensorInfo
        if isinstance(name, ModelShape):
            self.name, self.shape = f"{name.arch}-custom", name
        elif name in SHAPES:
            self.name, self.shape = name, SHAPES[name]
        else:
            from ..errors import LuceError
            raise LuceError(f"unknown synthetic model {name!r} (choose from {', '.join(SHAPES)})")
        types = types or q4_k_m_type
        self.path = Path(f"synthetic:{self.name}")
        self.metadata = {**shape_metadata(self.shape), **byte_tokenizer_metadata(self.shape.vocab_size)}
        self.tensors = {}
        for tname, shp in self.shape.tensor_shapes().items():
            qt = fit_type(types(tname), shp[-1])
            self.tensors[tname] = TensorInfo(tname, qt, tuple(shp), _nbytes(qt, shp), None)

    def config(self):
        from ..plugins import family_for
        return family_for(self.path, self.architecture).read_config(self)

    @property
    def weight_bytes_per_token(self) -> int:
        """Bytes a decode step reads: every matrix but the embedding table (one row of it)."""
        return sum(t.n_bytes for n, t in self.tensors.items() if n != "token_embd.weight" or self.shape.tied_output)


def _nbytes(qtype, shape) -> int:
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def synthetic_loader(backend, seed: int = 0, pool_mb: int = 64):
    """load(TensorInfo) for a backend: random valid rows, made once per (type, width) in
    a pool and tiled, so a 20 GB model loads in seconds (values repeat; speed does not care).
    Each matrix starts at its own pool row (from its name), so that layers differ and gate
    is not up (from row 0 every layer was the same matrix). Such models' greedy output is
    degenerate (one or two tokens over and over), so the spec bench's lossless column on
    them says little: losslessness is tested on real models (docs/benchmarks.md, forty-first
    session)."""
    import gguf
    from ..gguf_file import TensorInfo
    Qt = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    pools: dict = {}

    def load(info):
        if len(info.shape) == 1 or info.qtype == Qt.F32:
            data = random_tensor(info.name, info.shape, Qt.F32, rng)
            return backend.load_tensor(TensorInfo(info.name, Qt.F32, info.shape, data.nbytes,
                                                  data.view(np.uint8).reshape(-1)))
        rows, cols = info.shape
        key = (info.qtype, cols)
        if key not in pools:
            block, tsize = gguf.GGML_QUANT_SIZES[info.qtype]
            pool_rows = max(1, (pool_mb << 20) // (cols // block * tsize))
            if info.qtype == Qt.F16:
                pools[key] = (0.02 * rng.standard_normal((pool_rows, cols))).astype(np.float16).view(np.uint8)
            else:
                pools[key] = random_quant_rows(info.qtype, pool_rows, cols, rng)
        start = zlib.crc32(info.name.encode()) % len(pools[key])
        return backend.tiled_weight(pools[key], info.qtype, rows, cols, info.name, start=start)

    return load
