"""Generation through the public Python API on the real SmolLM2-135M."""

def test_capital_of_france_greedy(smollm2):
    out = smollm2.generate("The capital of France is", max_tokens=8, temperature=0)
    assert out.startswith(" Paris")


def test_stream_equals_one_shot_and_reuses_prefix(smollm2):
    prompt = "Once upon a time, in a small village,"
    one = smollm2.generate(prompt, max_tokens=24, temperature=0)
    deltas = list(smollm2.stream(prompt, max_tokens=24, temperature=0))
    assert "".join(d.text for d in deltas) == one
    last = deltas[-1]
    assert last.finish_reason in ("length", "stop") and last.stats.completion_tokens <= 24
    # the second call found the prompt (but its last token) in the session's cache
    assert last.stats.cached_tokens == last.stats.prompt_tokens - 1


def test_max_tokens_and_stop_strings(smollm2):
    full = smollm2.generate("1, 2, 3, 4,", max_tokens=12, temperature=0)
    assert " 6" in full
    cut = smollm2.generate("1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 6"])
    assert cut == full[:full.index(" 6")]
    deltas = list(smollm2.stream("1, 2, 3, 4,", max_tokens=3, temperature=0))
    assert deltas[-1].finish_reason == "length" and deltas[-1].stats.completion_tokens == 3


def test_seeded_sampling_is_reproducible(smollm2):
    a = smollm2.generate("The weather today", max_tokens=12, temperature=1.0, seed=3)
    b = smollm2.generate("The weather today", max_tokens=12, temperature=1.0, seed=3)
    assert a == b


def test_chat_uses_template_and_stops_at_end_of_turn(smollm2):
    ids = smollm2.chat_prompt_ids([{"role": "user", "content": "Say hello."}])
    text = smollm2.detokenize(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    deltas = list(smollm2.stream(ids, max_tokens=64, temperature=0))
    assert deltas[-1].finish_reason == "stop"
    assert "<|im_end|>" not in "".join(d.text for d in deltas)


def test_repetition_penalty_changes_greedy_output(smollm2):
    plain = smollm2.generate("a a a a a a a a", max_tokens=6, temperature=0)
    penalized = smollm2.generate("a a a a a a a a", max_tokens=6, temperature=0, repeat_penalty=3.0)
    assert plain != penalized


def test_prefill_pieces():
    from luce.engine.generator import prefill_pieces
    assert prefill_pieces(300, chunk=512) == [300]
    assert prefill_pieces(300, chunk=512, pow2=True) == [256, 32, 8, 4]
    assert prefill_pieces(1100, chunk=512, pow2=True) == [512, 512, 64, 8, 4]
    assert prefill_pieces(1024, chunk=512, pow2=True) == [512, 512]
    assert prefill_pieces(0, pow2=True) == []
    for n in range(1, 1500, 37):  # every piece a power of two at most the chunk, covering n
        sizes = prefill_pieces(n, chunk=512, pow2=True)
        assert sum(sizes) == n and all(s & (s - 1) == 0 and s <= 512 for s in sizes)


def test_session_prefill_in_pieces_equals_one_forward(smollm2):
    """A backend asking for power-of-two pieces gets the same logits as one forward."""
    import numpy as np
    ids = smollm2.tokenize("The quick brown fox jumps over the lazy dog. " * 4)[:37]
    be = smollm2.backend
    whole, _ = smollm2.new_session().prefill(ids)
    be.graph_prefill = True  # 37 -> 32 + 4 + 1
    try:
        pieces, _ = smollm2.new_session().prefill(ids)
    finally:
        del be.graph_prefill
    np.testing.assert_allclose(pieces, whole, rtol=0, atol=1e-3)
