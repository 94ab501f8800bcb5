"""Text side of luce: GGUF tokenizers and streaming detokenization."""

from luce.text.detokenizer import StreamingDetokenizer
from luce.text.tokenizer import Tokenizer, read_tokenizer_metadata

__all__ = ["StreamingDetokenizer", "Tokenizer", "read_tokenizer_metadata"]
