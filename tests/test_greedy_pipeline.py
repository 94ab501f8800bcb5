"""Decoding with the next step queued on the device (DeviceStepper), greedy and sampled: the
same tokens as the plain stepper (for a seed), and a cache that holds exactly the kept tokens afterwards
(stops, length limits, a consumer that leaves early, the next turn's prefix reuse). The
stepper runs on the CPU backend's forward_next_token (same contract, computed at once); the
CUDA backend's, with its argmax (or draw) inside the forward and the token taken on the
device, is checked in numba's simulator against the CPU's tokens (two steps: a simulated
decode step takes ~16 s). The pinned staging ring's bookkeeping is tested on its own."""
import numpy as np
import pytest

from luce.backends.cuda_copy import Ring
from luce.engine.generator import DeviceStepper, PlainStepper, Session, device_steps, generate
from luce.engine.sampling import Sampler, SamplingParams


def test_ring_hands_out_aligned_ranges_and_says_when_it_wraps():
    r = Ring(64)
    assert r.take(4) == (0, False)
    assert r.take(20) == (16, False)  # 16-byte aligned starts
    assert r.take(16) == (48, False)
    assert r.take(1) == (0, True)  # 64 + 1 > 64: a new lap
    assert r.take(64 - 16) == (16, False)
    with pytest.raises(ValueError):
        r.take(65)


class _Tok:
    bos_id = None
    strip_leading_space = False
    clean_spaces = False

    def __init__(self, eog=()):
        self.eog_ids = list(eog)

    def token_bytes(self, i, skip_special=False):
        return f"<{i}>".encode()


class _Model:
    """What Session and generate use of luce.model.Model, over a backend and raw weights."""

    def __init__(self, backend, fam, cfg, weights, eog=()):
        self.backend, self.family, self.config, self.weights = backend, fam, cfg, weights
        self.tokenizer = _Tok(eog)

    def forward(self, cache, tokens, positions, mask=None, logits_rows=None):
        return self.backend.forward(self.family, self.config, self.weights, cache, tokens, positions, mask=mask,
                                    logits_rows=logits_rows)

    def forward_next_token(self, cache, token, position, sample=None):
        return self.backend.forward_next_token(self.family, self.config, self.weights, cache, token, position,
                                               sample=sample)

    def set_penalty_history(self, cache, history, repeat_last_n):
        self.backend.set_penalty_history(self.family, self.config, self.weights, cache, history, repeat_last_n)


def _tiny(tmp_path_factory, backend):
    import gguf
    from luce.bench.synthetic import tiny, write_gguf
    from luce.gguf_file import GGUFFile
    from luce.models.transformer import build_weights
    from luce.plugins import family_for
    Q = gguf.GGMLQuantizationType
    shape = tiny("qwen3", 64, n_layers=1, n_embd=64, n_ff=64, n_heads=2, n_kv_heads=1, head_dim=32)
    path = write_gguf(tmp_path_factory.mktemp("q3") / "tiny.gguf", shape,
                      types=lambda n: Q.F32 if "norm" in n else Q.Q8_0, seed=5)  # F16: ~2 s a simulated product
    f = GGUFFile(path)
    fam = family_for(path, f.architecture)
    cfg = fam.read_config(f)
    return backend, fam, cfg, build_weights(cfg, f, backend.load_tensor)


@pytest.fixture(scope="module")
def tiny_cpu(tmp_path_factory):
    from luce.backends.cpu import CPUBackend
    return _tiny(tmp_path_factory, CPUBackend())


def _run(model, prompt, params, pipelined, session=None, take=None):
    s = session or Session(model, 48)
    stepper = DeviceStepper(s, min(params.max_tokens, s.n_ctx - len(prompt)), Sampler(params)) if pipelined else None
    ids = []
    gen = generate(s, prompt, params, stepper=stepper)
    for d in gen:
        ids += d.token_ids
        if take is not None and len(ids) >= take:
            gen.close()  # a client that leaves early
            break
    return ids, s


@pytest.mark.parametrize("temperature,penalties", [(0.0, {}), (1.3, {}), (0.0, {"repeat_penalty": 1.5}),
                                                   (1.3, {"repeat_penalty": 1.3, "presence_penalty": 0.4,
                                                          "frequency_penalty": 0.2, "repeat_last_n": 3})])
def test_same_tokens_as_the_plain_stepper_and_a_cache_of_the_kept_tokens(tiny_cpu, temperature, penalties):
    model = _Model(*tiny_cpu)
    greedy = SamplingParams(temperature=temperature, top_p=0.99, min_p=0.0, max_tokens=12, seed=4, **penalties)
    prompt = [3, 17, 42, 5]
    want, s_plain = _run(model, prompt, greedy, pipelined=False)
    got, s = _run(model, prompt, greedy, pipelined=True)
    assert got == want and len(got) == 12
    assert s.cache.n_past == len(s.tokens) == s_plain.cache.n_past == len(prompt) + 11  # the last is never fed
    # the next turn reuses the cache's prefix: it must hold exactly those rows
    turn2 = prompt + want + [9]
    want2, _ = _run(model, turn2, greedy.with_(max_tokens=4), pipelined=False, session=s_plain)
    got2, _ = _run(model, turn2, greedy.with_(max_tokens=4), pipelined=True, session=s)
    assert got2 == want2
    assert s.cache.n_past == len(s.tokens)


def test_stop_token_and_early_close_leave_no_queued_rows(tiny_cpu):
    be, fam, cfg, w = tiny_cpu
    greedy = SamplingParams(temperature=0, max_tokens=16)
    prompt = [7, 1, 30]
    free, _ = _run(_Model(be, fam, cfg, w), prompt, greedy, pipelined=False)
    stop = free[5]  # the 6th token ends generation (if it is not also earlier)
    model = _Model(be, fam, cfg, w, eog=[stop])
    want, _ = _run(model, prompt, greedy, pipelined=False)
    got, s = _run(model, prompt, greedy, pipelined=True)
    assert got == want == free[:free.index(stop)]
    assert s.cache.n_past == len(s.tokens) == len(prompt) + len(got)  # the queued step past the stop is gone
    got3, s3 = _run(_Model(be, fam, cfg, w), prompt, greedy, pipelined=True, take=3)
    assert got3 == free[:len(got3)] and s3.cache.n_past == len(s3.tokens)


def test_generate_picks_the_device_stepper_without_penalties_and_with_a_top_k_it_draws():
    class B:
        pipelined_greedy = True
        device_sampling = True

    class M:
        backend = B()

        class config:
            vocab_size = 151_936

        def forward_next_token(self, *a):
            pass

        def set_penalty_history(self, *a):
            pass

    s = Session.__new__(Session)
    s.model = M()
    assert device_steps(s, SamplingParams(temperature=0))
    assert device_steps(s, SamplingParams(temperature=0.7))  # the defaults: top-k 40
    assert not device_steps(s, SamplingParams(temperature=0.7, top_k=0))  # no top-k: the host's sampler
    assert device_steps(s, SamplingParams(temperature=0, repeat_penalty=1.1))  # a top-1 draw with penalties
    assert device_steps(s, SamplingParams(temperature=0.7, presence_penalty=0.5))
    assert not device_steps(s, SamplingParams(temperature=0.7, presence_penalty=0.5, repeat_last_n=10_000))
    B.device_sampling = False
    assert device_steps(s, SamplingParams(temperature=0)) and not device_steps(s, SamplingParams(temperature=0.7))
    assert not device_steps(s, SamplingParams(temperature=0, repeat_penalty=1.1))
    B.pipelined_greedy = False
    assert not device_steps(s, SamplingParams(temperature=0))
    assert isinstance(PlainStepper(s, Sampler(SamplingParams())), PlainStepper)


def test_cuda_forward_next_token_in_simulator(tmp_path_factory, tiny_cpu):
    """Two queued steps, the first greedy, the second taking its token on the device and
    drawing the next with a temperature and penalties, give the CPU's tokens; the rows they wrote are
    committed like any decode step's."""
    from luce.backends.cuda import CUDABackend
    be, fam, cfg, w = _tiny(tmp_path_factory, CUDABackend(use_graphs=False))
    cpu, _, _, w_cpu = tiny_cpu
    sp = Sampler(SamplingParams(temperature=1.5, top_k=50, top_p=0.98, min_p=0.0, seed=2, repeat_penalty=1.4,
                                frequency_penalty=0.3)).device_params()
    kv_cpu = cpu.new_cache(cfg, 8)
    want = [cpu.forward_next_token(fam, cfg, w_cpu, kv_cpu, 11, 0).result()]
    kv_cpu.commit()
    history = [11, want[0], 5, 5]  # penalized by the second step's draw
    cpu.set_penalty_history(fam, cfg, w_cpu, kv_cpu, history, 3)
    want.append(cpu.forward_next_token(fam, cfg, w_cpu, kv_cpu, None, 1, sample=sp).result())
    kv = be.new_cache(cfg, 8)
    be.set_penalty_history(fam, cfg, w, kv, history, 3)
    with pytest.raises(RuntimeError):
        be.forward_next_token(fam, cfg, w, kv, None, 0)  # nothing queued yet to take a token from
    first = be.forward_next_token(fam, cfg, w, kv, 11, 0)
    kv.commit()
    second = be.forward_next_token(fam, cfg, w, kv, None, 1, sample=sp)  # queued before `first` is read
    kv.commit()
    assert [first.result(), second.result()] == want
    assert kv.n_past == 2
