"""Incremental detokenization for streamed generation.

Text is emitted only once it can no longer change: an incomplete UTF-8
sequence (a character split across byte-level or `<0xXX>` tokens) waits for
its remaining bytes, and when the tokenizer cleans up spaces (" ." -> ".",
" n't" -> "n't"), a space that the next few characters may still remove
waits for them.
The concatenation of every push() and the final flush() is exactly
`tokenizer.decode(all_ids, skip_special)`.
"""

from __future__ import annotations

import codecs

from luce.text.tokenizer import Tokenizer, clean_up_spaces_stream

__all__ = ["StreamingDetokenizer"]


class StreamingDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        # The incremental decoder gives, chunk by chunk, exactly what
        # bytes.decode("utf-8", "replace") gives for the whole stream.
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = ""
        self._at_start = tokenizer.strip_leading_space
        self._clean = tokenizer.clean_spaces

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often "")."""
        piece = self.tokenizer.token_bytes(token_id, self.skip_special)
        self.ids.append(token_id)
        return self._emit(self._utf8.decode(piece), final=False)

    def flush(self) -> str:
        """Return everything still held back; the stream is finished."""
        return self._emit(self._utf8.decode(b"", final=True), final=True)

    def _emit(self, text: str, final: bool) -> str:
        pending = self._pending + text
        if self._at_start:
            if not pending:
                return ""
            # decode() drops one space at the very start of the text.
            if pending[0] == " ":
                pending = pending[1:]
            self._at_start = False
        if not self._clean:
            self._pending = ""
            return pending
        out, self._pending = clean_up_spaces_stream(pending, final)
        return out
