"""Fill-in-the-middle prompts: code completion between what comes before the cursor and what
comes after it, for models trained with FIM tokens (Qwen2.5-Coder, StarCoder, CodeLlama,
DeepSeek-Coder). Editors' completion plugins send the two sides (and, for repository-level
models, other files) and expect only the middle back.

The prompt is llama.cpp's (server `format_infill`), so a plugin written against its
`/infill` gets the same tokens: [other files] [BOS] PRE prefix SUF suffix MID, the other
files as REP "myproject\\n" then SEP "name\\n" text each, where the model has those tokens.
User text is tokenized without parsing special tokens: code that contains "<|im_end|>"
stays text.
"""
from __future__ import annotations

from dataclasses import dataclass

# Token texts of each role where the file names no id, in llama.cpp's lookup order
# (llama_vocab::impl::load).
_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<\uff5cfim\u2581begin\uff5c>", "<fim_prefix>", "<PRE>", "\u2581<PRE>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<\uff5cfim\u2581hole\uff5c>", "<fim_suffix>", "<SUF>", "\u2581<SUF>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<\uff5cfim\u2581end\uff5c>", "<fim_middle>", "<MID>", "\u2581<MID>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>", "<fim-sep>"),
}
_KEYS = {r: f"tokenizer.ggml.fim_{r}_token_id" for r in _TEXTS}
# llama.cpp's separator between other files where the model has no SEP token
_SNIPPET = "\n\n--- snippet ---\n\n"
SUFFIX_SHARE = 4  # of the room left for the two sides, the suffix gets at most 1/4 (llama.cpp's 3:1)


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int | None = None
    sep: int | None = None


def fim_tokens(tokenizer) -> FimTokens | None:
    """The model's FIM token ids, from the file's keys or else by their texts; None where
    it has no prefix, suffix and middle tokens (it cannot fill in the middle)."""
    meta = tokenizer.metadata
    n = tokenizer.vocab_size
    ids = {}
    for role, texts in _TEXTS.items():
        v = meta.get(_KEYS[role])
        if v is not None and 0 <= int(v) < n:
            ids[role] = int(v)
        else:
            ids[role] = next((i for i in map(tokenizer.token_to_id, texts) if i is not None), None)
    if None in (ids["pre"], ids["suf"], ids["mid"]):
        return None
    return FimTokens(**ids)


def infill_ids(tokenizer, fim: FimTokens, prefix: str, suffix: str, extra=(), prompt: str = "",
               budget: int | None = None) -> list[int]:
    """The FIM prompt's ids. `extra`: other files as (filename, text) pairs, put before the
    prefix; `prompt`: text that follows the prefix (what llama.cpp's /infill appends there).
    Past `budget` tokens, what is farthest from the cursor goes first: the start of the
    extra files, then the start of the prefix and the end of the suffix, the suffix
    keeping at most a quarter of the room."""
    def enc(text):
        return tokenizer.encode(text, add_special=False, parse_special=False) if text else []

    head = []
    if fim.rep is not None:
        head = [fim.rep] + enc("myproject\n")
    for name, text in extra:
        head += ([fim.sep] + enc(f"{name}\n")) if fim.sep is not None else enc(_SNIPPET)
        head += enc(text)
    if fim.sep is not None:  # the file being edited (llama.cpp has no name for it either)
        head += [fim.sep] + enc("filename\n")
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    pre, suf, tail = enc(prefix), enc(suffix), enc(prompt)
    if budget is not None:
        room = budget - len(bos) - len(tail) - 3  # PRE, SUF, MID
        if room < 1:
            raise ValueError(f"no room for the prefix or suffix in {budget} tokens")
        suf = suf[:max(min(len(suf), room // SUFFIX_SHARE), room - len(pre))]
        pre = pre[max(0, len(pre) - (room - len(suf))):]
        room -= len(pre) + len(suf)
        head = head[len(head) - room:] if room < len(head) else head
    return head + bos + [fim.pre] + pre + tail + [fim.suf] + suf + [fim.mid]
