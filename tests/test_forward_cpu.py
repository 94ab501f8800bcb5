"""The CPU forward's own consistency: incremental decode, chunked prefill and tree
verification must all give the logits of one plain causal pass."""
import numpy as np
import pytest

from luce.kernels.attention import tree_mask
from luce.kv.cache import KVCache

TOKENS = [504, 3575, 282, 4649, 314, 7042, 30, 198, 504, 2988, 314, 42]


@pytest.fixture(scope="module")
def parts(smollm2):
    """(config, weights, backend-like) where forward(cfg, w, kv, ...) runs the model."""
    m = smollm2
    be = type("Runner", (), {"forward": staticmethod(lambda cfg, w, kv, *a, **k: m.forward(kv, *a, **k)),
                             "new_cache": staticmethod(m.backend.new_cache)})
    return m.config, m.weights, be


def full_pass(parts, tokens):
    cfg, w, be = parts
    kv = be.new_cache(cfg, 64)
    return be.forward(cfg, w, kv, tokens, np.arange(len(tokens)))


def test_smollm2_top_token_is_paris(parts):
    logits = full_pass(parts, TOKENS[:5])
    assert int(np.argmax(logits[-1])) == 7042  # " Paris"


def test_incremental_decode_matches_full_pass(parts):
    cfg, w, be = parts
    ref = full_pass(parts, TOKENS)
    kv = be.new_cache(cfg, 64)
    be.forward(cfg, w, kv, TOKENS[:3], np.arange(3))
    kv.commit()
    for i in range(3, len(TOKENS)):
        lg = be.forward(cfg, w, kv, [TOKENS[i]], [i])
        kv.commit()
        np.testing.assert_allclose(lg[0], ref[i], rtol=1e-4, atol=1e-4)


def test_tree_verification_matches_chains(parts):
    """Two branches after a shared prefix, verified in one forward, give each branch's
    own causal logits; committing one branch leaves the cache as if only it had run."""
    cfg, w, be = parts
    prefix, a, b = TOKENS[:4], [4649, 314, 7042], [2988, 314]
    kv = be.new_cache(cfg, 64)
    be.forward(cfg, w, kv, prefix, np.arange(4))
    kv.commit()
    # nodes: a0 a1 a2 b0 b1 ; parents -1 0 1 -1 3
    nodes = a + b
    parents = np.array([-1, 0, 1, -1, 3])
    depth = np.array([0, 1, 2, 0, 1])
    lg = be.forward(cfg, w, kv, nodes, 4 + depth, mask=tree_mask(parents))
    ref_a = full_pass(parts, prefix + a)[4:]
    ref_b = full_pass(parts, prefix + b)[4:]
    np.testing.assert_allclose(lg[:3], ref_a, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(lg[3:], ref_b, rtol=1e-4, atol=1e-4)
    kv.commit([3, 4])  # accept branch b
    assert kv.n_past == 6
    nxt = be.forward(cfg, w, kv, [42], [6])
    np.testing.assert_allclose(nxt[0], full_pass(parts, prefix + b + [42])[-1], rtol=1e-4, atol=1e-4)


def test_kv_commit_moves_rows_and_rejects_bad_indices():
    kv = KVCache(n_layers=1, n_ctx=8, n_kv_heads=1, head_dim=2)
    kv.reserve(4)
    rows = np.arange(8, dtype=np.float32).reshape(4, 1, 2)
    kv.write(0, rows, -rows, np.array([0, 1, 1, 2]))
    kv.commit([0, 2, 3])
    assert kv.n_past == 3
    np.testing.assert_array_equal(kv.k[0, :3], rows[[0, 2, 3]])
    np.testing.assert_array_equal(kv.pos[:3], [0, 1, 2])
    kv.reserve(1)
    with pytest.raises(IndexError):
        kv.commit([1])
    with pytest.raises(ValueError):
        kv.reserve(6)
