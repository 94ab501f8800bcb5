"""The CUDA backend's draft loop in the CUDA simulator: a greedy draft's steps queued on the
device (luce.spec.DraftModel on the CUDA backend), each through the persistent decode kernel
as on a GPU, against the host loop over whole logits rows through the launch chain. Its own
file (one draft forward is ~4 s in the simulator, the test ~3.5 minutes) so that CI's
workers (pytest-xdist, by file) share it with tests/test_cuda_backend_sim.py."""
import math

import numpy as np


def test_draft_steps_on_the_device_propose_the_host_draft(tmp_path, monkeypatch):
    """A greedy draft on the CUDA backend queues its steps with the candidates taken on the
    device (forward_topk: top-k and log-sum-exp in the step, the next step's token left
    there), its one-token steps in the persistent kernel: the same tokens, candidates and,
    to float rounding, log-probabilities as the host loop over full logits rows; more steps
    than the readback slots, and a second call that reuses the committed prefix."""
    import gguf

    import luce
    from luce.backends import cuda as cuda_backend
    from luce.backends.cuda import CUDABackend
    from luce.bench.synthetic import tiny, write_gguf
    from luce.spec import DraftModel
    Q = gguf.GGMLQuantizationType
    # 300 tokens: a vocabulary the byte-level tokenizer fits (luce.load wants one)
    path = write_gguf(tmp_path / "draft.gguf", tiny("llama", 300, n_layers=1, n_embd=64, n_ff=64, n_heads=2,
                                                    n_kv_heads=1, head_dim=32),
                      types=lambda n: Q.F32 if "norm" in n else Q.Q8_0, seed=3)
    # load's warm-up compiles every width up to a prefill chunk: minutes in the simulator
    monkeypatch.setattr(CUDABackend, "warmup", lambda *a, **k: None)
    # two readback slots: three steps already read them in two rounds (a forward is ~4 s here)
    monkeypatch.setattr(cuda_backend, "TOKEN_SLOTS", 2)
    model = luce.load(path, backend=CUDABackend(use_graphs=False), n_ctx=64)
    host = DraftModel(model, n_ctx=64, top_k=4, on_device=False)
    dev = DraftModel(model, n_ctx=64, top_k=4)
    assert dev.on_device and not host.on_device
    # the device loop's one-token steps through the persistent kernel (the GPU's default for
    # a draft), the host loop's through the launch chain: a cache's choice is made with its
    # state, so each state is made under its setting
    be, args = model.backend, (model.family, model.config, model.weights)
    monkeypatch.setattr(cuda_backend, "PERSISTENT_DECODE", False)
    assert be._model_state(*args, host.session.cache)["persistent"] is None
    # the launch chain would run steps past a stop: no chain with a cut-off is set there
    assert not host.session.begin_chain(4, 0.0) and "topk" not in be._model_state(*args, host.session.cache)
    monkeypatch.setattr(cuda_backend, "PERSISTENT_DECODE", True)
    pd = be._model_state(*args, dev.session.cache)["persistent"]
    assert pd is not None
    steps = []
    forward = pd.forward
    monkeypatch.setattr(pd, "forward", lambda *a: steps.append(1) or forward(*a))
    ctx = [3, 9, 4, 1, 7]
    for n in (3, 1):  # 3: more steps than the two slots; 1: a second call on the committed prefix
        a, b = host.propose(ctx, n), dev.propose(ctx, n)
        assert b.tokens == a.tokens and len(b.tokens) == n
        np.testing.assert_array_equal(b.topk_ids, a.topk_ids)
        np.testing.assert_allclose(b.topk_logp, a.topk_logp, rtol=0, atol=1e-5)
        assert dev.session.tokens == host.session.tokens == ctx + a.tokens[:-1]
        ctx = ctx + a.tokens[:2] + [11]  # the target took two and chose its own third
    # queued ahead (the next draft guessed before the target judged this one: the chain's
    # last token, then the draft's own next token g, then g's continuation): proposing
    # after the whole chain and g takes those steps, the same draft as the host loop's; any
    # other context drops them and rewinds over their rows
    a, b = host.propose(ctx, 2), dev.propose(ctx, 2)
    host.queue_ahead(2), dev.queue_ahead(2)
    g = int(host._ahead[1][0][0][0])
    ctx = ctx + a.tokens + [g]
    a, b = host.propose(ctx, 2), dev.propose(ctx, 2)
    assert host.ahead_hits == dev.ahead_hits == 1
    assert b.tokens == a.tokens and len(b.tokens) == 2
    np.testing.assert_array_equal(b.topk_ids, a.topk_ids)
    np.testing.assert_allclose(b.topk_logp, a.topk_logp, rtol=0, atol=1e-5)
    assert dev.session.tokens == host.session.tokens == ctx + a.tokens[:-1]
    host.queue_ahead(2), dev.queue_ahead(2)
    ctx = ctx + a.tokens[:1] + [11]
    a, b = host.propose(ctx, 1), dev.propose(ctx, 1)
    assert host.ahead_hits == dev.ahead_hits == 1 and host.ahead_tries == dev.ahead_tries == 2
    assert b.tokens == a.tokens and dev.session.tokens == host.session.tokens == ctx
    # p_min (set on the same drafts: no second prefill in the simulator): both loops stop at
    # the first position where the chain's probability falls below it (here the second).
    # The device loop takes the stop on the device (its steps through the persistent
    # kernel): all three steps queued at once, the third did nothing, and its session holds
    # the host's rows. The chain is left never to stop (for steps without a cut-off).
    full = host.propose(ctx, 3)
    chain = np.cumsum(full.topk_logp[:, 0])
    p_min = float(np.exp((chain[0] + chain[1]) / 2))
    host.log_p_min = dev.log_p_min = math.log(p_min)
    before, forwards = len(steps), dev.forwards
    a, b = host.propose(ctx, 3), dev.propose(ctx, 3)
    assert a.tokens == b.tokens == full.tokens[:2]
    np.testing.assert_array_equal(b.topk_ids, full.topk_ids[:2])
    assert host.session.tokens == dev.session.tokens == ctx + a.tokens[:1]
    assert dev.session.cache.n_past == len(dev.session.tokens)
    assert len(steps) - before == 3 and dev.forwards - forwards == 2  # three queued, two ran
    from luce.kernels.sampling import CHAIN_CUT, CHAIN_STOPPED
    ch = be._model_state(*args, dev.session.cache)["topk"][4]["scratch"][4].copy_to_host()
    assert ch[0, CHAIN_STOPPED] == 0 and ch[0, CHAIN_CUT] == -np.inf
    assert len(steps) >= 7  # the device loop's one-token steps went through the kernel
    # a lookup guess carried by the catch-up (seed width 4: the catch-up and the guess padded
    # to 4 tokens, every row's candidates): where the guess is the draft's own chain, the
    # draft comes from that one forward; where it leaves the chain, the rows past that are
    # dropped and a one-token step goes on from the draft's own token. The same draft either
    # way (both proposals of the same context: the second catches up one token).
    from luce.spec.drafters import Draft
    host.log_p_min = dev.log_p_min = -math.inf
    ctx = ctx + a.tokens[:1] + [5]
    full = host.propose(ctx, 2)
    dev.seed_width = 4
    for guess, forwards in ((full.tokens[:1], 1), ([(full.tokens[0] + 1) % 300], 2)):
        dev.lookup = type("Guess", (), {"propose": lambda self, c, m, g=guess: Draft(g[:m], None, None)})()
        before = dev.forwards
        b = dev.propose(ctx, 2)
        assert b.tokens == full.tokens and dev.forwards - before == forwards
        np.testing.assert_array_equal(b.topk_ids, full.topk_ids)
        # a 4-token forward against one-token steps: their own summation orders (~1e-4 apart)
        np.testing.assert_allclose(b.topk_logp, full.topk_logp, rtol=0, atol=5e-4)
        assert dev.session.tokens == ctx + full.tokens[:-1] and dev.session.cache.n_past == len(ctx) + 1
    assert dev.seeded == 1 and dev.seed_tries == 2
