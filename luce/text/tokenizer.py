"""Tokenizers described by GGUF metadata, run on Hugging Face `tokenizers`.

A GGUF carries no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` keys, and
llama.cpp (src/llama-vocab.cpp) is the authority on what they mean. We translate
them into a `tokenizers` pipeline instead of porting llama.cpp's merge loops:

* `gpt2`  -> byte-level BPE: llama.cpp's regex splits for `tokenizer.ggml.pre`,
  then the file's merges.
* `llama` -> SentencePiece BPE: spaces become U+2581, merges are rebuilt from
  the scores (llama.cpp merges the adjacent pair whose result scores highest,
  which is BPE with merges ranked by that score), unknown characters fall back
  to `<0xXX>` byte tokens.

Control and user-defined tokens are added tokens, so they are matched whole in
the raw text before any splitting, as llama.cpp's `tokenizer_st_partition` does.
Decoding does not go through `tokenizers`: each id maps to a fixed byte string,
which is what lets the streaming detokenizer reproduce `decode` exactly.
"""

from __future__ import annotations

import mmap
import re
import struct
import threading
from dataclasses import dataclass
from os import PathLike
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from luce.errors import LuceError

__all__ = [
    "Tokenizer",
    "UnsupportedTokenizerError",
    "read_tokenizer_metadata",
    "clean_up_spaces",
    "SUPPORTED_PRE",
    "TOKEN_NORMAL",
    "TOKEN_UNKNOWN",
    "TOKEN_CONTROL",
    "TOKEN_USER_DEFINED",
    "TOKEN_UNUSED",
    "TOKEN_BYTE",
]

# llama.cpp's llama_token_type values as stored in tokenizer.ggml.token_type.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_SPM_SPACE = "\u2581"


class UnsupportedTokenizerError(LuceError, ValueError):
    """The GGUF describes a tokenizer type or pre-tokenizer luce does not implement."""

# --------------------------------------------------------------------------- #
# Pre-tokenizer splits, per tokenizer.ggml.pre (from llama.cpp's llm_tokenizer_bpe).
# Several regexes are applied in sequence, each splitting the pieces left by the
# previous one and keeping the unmatched text as pieces of their own.
# --------------------------------------------------------------------------- #
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _Pre:
    splits: tuple[str, ...]
    # A whole pre-token found in the vocabulary is emitted as is (Llama 3, Tekken).
    ignore_merges: bool = False
    # llama.cpp's tokenizer_clean_spaces, on by default for BPE vocabularies.
    clean_spaces: bool = True
    # Default for add_bos when the file has no tokenizer.ggml.add_bos_token.
    add_bos: bool = False


def _pre_table() -> dict[str, _Pre]:
    table: dict[str, _Pre] = {}

    def put(names: Iterable[str], pre: _Pre) -> None:
        for n in names:
            table[n] = pre

    put(["default"], _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")))
    put(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
        _Pre((_LLAMA3,), ignore_merges=True, add_bos=True),
    )
    put(["dbrx", "smaug-bpe"], _Pre((_LLAMA3,)))
    put(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"], _Pre((_QWEN2,), clean_spaces=False))
    put(["megrez", "stablelm2"], _Pre((_QWEN2,)))
    put(["chatglm-bpe", "glm4"], _Pre((_LLAMA3,)))
    put(["smollm", "command-r"], _Pre((r"\p{N}", _GPT2), clean_spaces=False))
    put(["starcoder", "refact", "codeshell", "exaone", "minerva-7b"], _Pre((r"\p{N}", _GPT2)))
    put(["gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "roberta-bpe", "mellum"], _Pre((_GPT2,)))
    put(["falcon"], _Pre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")))
    put(["gpt-4o", "llama4", "kanana2", "minimax-m2"], _Pre((_GPT4O,), clean_spaces=False))
    put(["tekken"], _Pre((_TEKKEN,), ignore_merges=True, clean_spaces=False, add_bos=True))
    put(
        ["deepseek-coder"],
        _Pre((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"), clean_spaces=False),
    )
    put(
        ["deepseek-v3"],
        _Pre(
            (
                r"\p{N}{1,3}",
                r"[一-龥぀-ゟ゠-ヿ]+",
                r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            ),
            clean_spaces=False,
        ),
    )
    put(["bloom", "gpt3-finnish"], _Pre((r" ?[^(\s|.,!?…。，、।۔،)]+",)))
    put(["poro-chat"], _Pre((r" ?[^(\s|.,!?…。，、।۔،)]+",), clean_spaces=False))
    put(["viking"], _Pre((r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"), clean_spaces=False))
    return table


_PRE = _pre_table()
SUPPORTED_PRE: frozenset[str] = frozenset(_PRE)

# Token texts llama.cpp treats as end of generation whatever their id
# (llama_vocab::impl::load); the FIM pad/separator ones end a completion too.
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<fim_pad>", "<fim-pad>",
)  # fmt: skip
# Used, in this order, to find an end-of-turn token when the file names none.
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
)  # fmt: skip


# --------------------------------------------------------------------------- #
# Decode-side space clean-up (llama.cpp's clean_spaces / HF's
# clean_up_tokenization_spaces), written as one left-to-right regex so that a
# stream can apply it piecewise and get the same text.
# --------------------------------------------------------------------------- #
_CLEAN_RE = re.compile(r" ([.?!,])| ' | (n't|'m|'s|'ve|'re)")
# Every alternative starts with a space and is at most this long, so whether a
# match starts at position p depends on text[p : p + _CLEAN_SPAN] alone.
_CLEAN_SPAN = 4


def _clean_repl(m: re.Match) -> str:
    return m.group(1) or m.group(2) or "'"


def clean_up_spaces(text: str) -> str:
    return _CLEAN_RE.sub(_clean_repl, text)


def clean_up_spaces_stream(text: str, final: bool) -> tuple[str, str]:
    """Clean up the part of `text` that later text cannot affect.

    Returns (cleaned, rest): feeding `rest + next_text` back in, and finally
    calling with final=True, yields exactly clean_up_spaces(whole text).
    """
    n = len(text)
    # Positions from here on may start a match that needs characters not seen yet.
    undecided = n if final else next((p for p in range(max(0, n - _CLEAN_SPAN + 1), n) if text[p] == " "), n)
    out, pos = [], 0
    for m in _CLEAN_RE.finditer(text):
        if m.start() >= undecided:
            break
        out.append(text[pos : m.start()])
        out.append(_clean_repl(m))
        pos = m.end()
    cut = max(pos, undecided)
    out.append(text[pos:cut])
    return "".join(out), text[cut:]


# --------------------------------------------------------------------------- #
# Metadata
# --------------------------------------------------------------------------- #
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_tokenizer_metadata(path: str | PathLike[str]) -> dict[str, Any]:
    """The `tokenizer.*` keys (and `general.architecture`) of a GGUF file.

    Values are plain Python: str, int, float, bool, and lists for arrays.

    gguf-py's GGUFReader takes ~9 s on a 262k-token vocabulary because it
    builds numpy views for every string; only the key/value header is needed
    here, so it is walked directly (GGUF v2/v3, little-endian). Anything else
    goes through GGUFReader.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in (2, 3):
            return _read_with_gguf_py(path)
        _, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24
        out: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _read_str(buf, pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            want = key.startswith("tokenizer.") or key == "general.architecture"
            value, pos = _read_value(buf, pos + 4, vtype, want)
            if want:
                out[key] = value
        return out


def _read_str(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    return buf[pos : pos + n].decode("utf-8", "replace"), pos + n


def _read_value(buf, pos: int, vtype: int, want: bool) -> tuple[Any, int]:
    if vtype in _SCALAR:
        fmt = _SCALAR[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _read_str(buf, pos)
    if vtype != _ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype}")
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in _SCALAR:
        fmt = _SCALAR[etype]
        size = struct.calcsize(fmt) * count
        values = list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos)) if want else None
        return values, pos + size
    if etype == _STRING:
        unpack = struct.Struct("<Q").unpack_from
        if not want:
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
            return None, pos
        values = []
        append = values.append
        for _ in range(count):
            n = unpack(buf, pos)[0]
            pos += 8
            append(buf[pos : pos + n].decode("utf-8", "replace"))
            pos += n
        return values, pos
    values = []
    for _ in range(count):  # nested arrays: rare, never tokenizer data
        v, pos = _read_value(buf, pos, etype, want)
        values.append(v)
    return values, pos


def _read_with_gguf_py(path) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(path)
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") or key == "general.architecture":
            value = field.contents()
            out[key] = value.tolist() if hasattr(value, "tolist") else value
    return out


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #
def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte <-> printable-character alphabet.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _as_list(value) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _text(value) -> str:
    # Readers differ: some hand GGUF strings over as bytes.
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _valid_id(value, n_vocab: int) -> int | None:
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < n_vocab else None


class Tokenizer:
    """A GGUF model's tokenizer. Thread-safe for encode/decode."""

    def __init__(self, meta: Mapping[str, Any]):
        model = meta.get("tokenizer.ggml.model")
        model = _text(model) if model is not None else None
        if model not in ("gpt2", "llama"):
            raise UnsupportedTokenizerError(
                f"tokenizer.ggml.model={model!r} is not supported (only 'gpt2' byte-level BPE "
                "and 'llama' SentencePiece)"
            )
        self.model: str = model
        tokens = [_text(t) for t in _as_list(meta["tokenizer.ggml.tokens"])]
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        types = [int(t) for t in _as_list(types)] if types is not None else [TOKEN_NORMAL] * n
        if len(types) != n:
            raise ValueError(f"token_type has {len(types)} entries for {n} tokens")
        self._tokens = tokens
        self._types = types

        if model == "gpt2":
            pre_name = _text(meta.get("tokenizer.ggml.pre") or "default")
            if pre_name not in _PRE:
                raise UnsupportedTokenizerError(
                    f"tokenizer.ggml.pre={pre_name!r} is not supported; known: {sorted(_PRE)}"
                )
            self.pre: str = pre_name
            pre = _PRE[pre_name]
            add_bos_default, add_space_default, self.clean_spaces = pre.add_bos, False, pre.clean_spaces
        else:
            self.pre = _text(meta.get("tokenizer.ggml.pre") or "default")
            pre = None
            add_bos_default, add_space_default, self.clean_spaces = True, True, False

        def flag(key: str, default: bool) -> bool:
            v = meta.get(key)
            return default if v is None else bool(v)

        self.add_bos: bool = flag("tokenizer.ggml.add_bos_token", add_bos_default)
        self.add_eos: bool = flag("tokenizer.ggml.add_eos_token", False)
        self.add_space_prefix: bool = flag("tokenizer.ggml.add_space_prefix", add_space_default)
        # llama.cpp drops the space that add_space_prefix put in front of the text.
        self.strip_leading_space: bool = model == "llama" and self.add_space_prefix

        self.bos_id = _valid_id(meta.get("tokenizer.ggml.bos_token_id"), n)
        self.eos_id = _valid_id(meta.get("tokenizer.ggml.eos_token_id"), n)
        self.pad_id = _valid_id(meta.get("tokenizer.ggml.padding_token_id"), n)
        self.unk_id = _valid_id(meta.get("tokenizer.ggml.unknown_token_id"), n)
        self.eom_id = _valid_id(meta.get("tokenizer.ggml.eom_token_id"), n)
        self.eot_id = _valid_id(meta.get("tokenizer.ggml.eot_token_id"), n)

        first_id: dict[str, int] = {}
        for i, t in enumerate(tokens):
            first_id.setdefault(t, i)
        self._first_id = first_id
        if self.eot_id is None:
            self.eot_id = next((first_id[t] for t in _EOT_TEXTS if t in first_id), None)
        eog = {first_id[t] for t in _EOG_TEXTS if t in first_id}
        eog.update(i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None)
        self.eog_ids: frozenset[int] = frozenset(eog)

        self.special_ids: frozenset[int] = frozenset(
            i for i, ty in enumerate(types) if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN)
        ) | frozenset(i for i in (self.bos_id, self.eos_id, self.eot_id, self.eom_id) if i is not None)

        self._pieces = self._build_pieces()
        self._build_args = (meta, pre)
        self._hf = self._build_hf(parse_special=True)
        self._hf_raw: _HFTokenizer | None = None
        self._lock = threading.Lock()

    # ---- construction -------------------------------------------------- #
    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        return cls(meta)

    @classmethod
    def from_gguf(cls, path: str | PathLike[str]) -> "Tokenizer":
        return cls(read_tokenizer_metadata(path))

    def _build_pieces(self) -> list[bytes]:
        """What each id contributes to decoded output, as llama.cpp's token_to_piece."""
        pieces: list[bytes] = []
        if self.model == "gpt2":
            byte_of = {c: b for b, c in _bytes_to_unicode().items()}
            to_latin1 = str.maketrans({c: chr(b) for c, b in byte_of.items()})
            for t, ty in zip(self._tokens, self._types):
                if ty == TOKEN_UNUSED:
                    pieces.append(b"")
                elif ty == TOKEN_NORMAL:
                    try:
                        pieces.append(t.translate(to_latin1).encode("latin-1"))
                    except UnicodeEncodeError:
                        # A character outside the byte alphabet: keep it as UTF-8.
                        pieces.append(b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode() for c in t))
                else:
                    pieces.append(t.encode())
        else:
            for t, ty in zip(self._tokens, self._types):
                if ty == TOKEN_UNUSED:
                    pieces.append(b"")
                elif ty == TOKEN_BYTE:
                    pieces.append(bytes([int(t[3:-1], 16)]))
                elif ty == TOKEN_NORMAL:
                    pieces.append(t.replace(_SPM_SPACE, " ").encode())
                else:
                    pieces.append(t.encode())
        return pieces

    def _build_hf(self, parse_special: bool) -> _HFTokenizer:
        meta, pre = self._build_args
        tokens, types = self._tokens, self._types
        vocab = self._first_id
        if self.model == "gpt2":
            merges = []
            raw_merges = meta.get("tokenizer.ggml.merges")
            for m in _as_list(raw_merges) if raw_merges is not None else []:
                m = _text(m)
                cut = m.find(" ", 1)
                left, right = m[:cut], m[cut + 1 :]
                if cut > 0 and left in vocab and right in vocab and left + right in vocab:
                    merges.append((left, right))
            hf = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
            hf.decoder = decoders.ByteLevel()
        else:
            merges = self._spm_merges(meta)
            unk = tokens[self.unk_id] if self.unk_id is not None else None
            hf = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token=unk))
            norm = [normalizers.Replace(" ", _SPM_SPACE)]
            if self.add_space_prefix:
                # Applied to each stretch of text between special tokens, which is
                # where llama.cpp puts its prefix space too.
                norm.insert(0, normalizers.Prepend(_SPM_SPACE))
            hf.normalizer = normalizers.Sequence(norm)
            hf.decoder = decoders.Sequence(
                [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
            )
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN) and t
        ]
        user = [
            AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED and t
        ]
        hf.add_special_tokens(special)
        hf.add_tokens(user)
        # llama.cpp keeps matching user-defined tokens when special parsing is off.
        hf.encode_special_tokens = not parse_special
        return hf

    def _spm_merges(self, meta) -> list[tuple[str, str]]:
        """Every split of a normal token into two normal tokens, best score first."""
        raw_merges = meta.get("tokenizer.ggml.merges")
        if raw_merges is not None and len(raw_merges):
            return [tuple(_text(m).split(" ", 1)) for m in _as_list(raw_merges)]
        tokens, types = self._tokens, self._types
        raw_scores = meta.get("tokenizer.ggml.scores")
        # Without scores, file order is the usual merge priority.
        scores = _as_list(raw_scores) if raw_scores is not None else [-float(i) for i in range(len(tokens))]
        normal = {t for t, ty in zip(tokens, types) if ty == TOKEN_NORMAL}
        ranked = []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty != TOKEN_NORMAL or len(t) < 2:
                continue
            s = -scores[i]
            for k in range(1, len(t)):
                if t[:k] in normal and t[k:] in normal:
                    ranked.append((s, i, k))
        ranked.sort()
        return [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]

    # ---- properties ---------------------------------------------------- #
    @property
    def metadata(self) -> Mapping[str, Any]:
        """The tokenizer.* metadata it was built from (other special-token ids: FIM's)."""
        return self._build_args[0]

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored in the GGUF (e.g. 'Ġthe', '▁the', '<0x0A>')."""
        return self._tokens[token_id]

    def token_type(self, token_id: int) -> int:
        return self._types[token_id]

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """What this id adds to decoded output (may be part of a UTF-8 character)."""
        if skip_special and token_id in self.special_ids:
            return b""
        if not 0 <= token_id < len(self._pieces):
            raise ValueError(f"token id {token_id} out of range [0, {len(self._pieces)})")
        return self._pieces[token_id]

    def token_to_id(self, text: str) -> int | None:
        return self._first_id.get(text)

    # ---- encode / decode ----------------------------------------------- #
    def _hf_for(self, parse_special: bool) -> _HFTokenizer:
        if parse_special:
            return self._hf
        if self._hf_raw is None:
            with self._lock:
                if self._hf_raw is None:
                    self._hf_raw = self._build_hf(parse_special=False)
        return self._hf_raw

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        ids = self._hf_for(parse_special).encode(text, add_special_tokens=False).ids if text else []
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str], add_special: bool = True, parse_special: bool = True) -> list[list[int]]:
        encs = self._hf_for(parse_special).encode_batch(list(texts), add_special_tokens=False)
        out = []
        for text, enc in zip(texts, encs):
            ids = enc.ids if text else []
            if add_special:
                if self.add_bos and self.bos_id is not None:
                    ids.insert(0, self.bos_id)
                if self.add_eos and self.eos_id is not None:
                    ids.append(self.eos_id)
            out.append(ids)
        return out

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        ids = list(ids)
        pieces = self._pieces
        if ids and (min(ids) < 0 or max(ids) >= len(pieces)):
            bad = next(i for i in ids if not 0 <= i < len(pieces))
            raise ValueError(f"token id {bad} out of range [0, {len(pieces)})")
        if skip_special:
            special = self.special_ids
            return b"".join([pieces[i] for i in ids if i not in special])
        return b"".join([pieces[i] for i in ids])

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.finish_text(self.decode_bytes(ids, skip_special).decode("utf-8", "replace"))

    def finish_text(self, text: str) -> str:
        """Whole-text post-processing that decode applies after joining the pieces."""
        if self.strip_leading_space and text.startswith(" "):
            text = text[1:]
        if self.clean_spaces:
            text = clean_up_spaces(text)
        return text

    def __repr__(self) -> str:
        return (
            f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos})"
        )
