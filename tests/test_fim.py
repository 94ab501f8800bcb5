"""Fill-in-the-middle: the prompt luce builds for a code model's FIM tokens (Qwen2.5-Coder's
tokenizer, checked against the same text tokenized with its special tokens parsed), its
fitting into a token budget, and the two routes that serve it on the real Qwen2.5-Coder-0.5B
(CPU backend): /v1/completions with a suffix and llama.cpp's /infill, whose greedy middle
of `def add(a, b): return ` is `a + b`."""
import json

import httpx
import openai
import pytest

from helpers_models import LiveServer
from luce.text.fim import FimTokens, fim_tokens, infill_ids
from luce.text.tokenizer import Tokenizer

PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nprint(add(2, 3))\n"


@pytest.fixture(scope="module")
def qwen_tok():
    from luce.models.test_models import qwen_coder_05b_path
    return Tokenizer.from_gguf(qwen_coder_05b_path())


def test_fim_tokens(qwen_tok, smollm2):
    got = fim_tokens(qwen_tok)
    assert got == FimTokens(pre=qwen_tok.token_to_id("<|fim_prefix|>"), suf=qwen_tok.token_to_id("<|fim_suffix|>"),
                            mid=qwen_tok.token_to_id("<|fim_middle|>"), rep=qwen_tok.token_to_id("<|repo_name|>"),
                            sep=qwen_tok.token_to_id("<|file_sep|>"))
    assert fim_tokens(smollm2.tokenizer) is None  # no prefix/suffix/middle tokens


def test_infill_prompt_is_the_special_token_text(qwen_tok):
    fim = fim_tokens(qwen_tok)
    ids = infill_ids(qwen_tok, fim, PREFIX, SUFFIX, [("util.py", "import os\n")])
    text = ("<|repo_name|>myproject\n<|file_sep|>util.py\nimport os\n<|file_sep|>filename\n"
            f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")
    assert ids == qwen_tok.encode(text, add_special=True, parse_special=True)
    # a prompt (llama.cpp's /infill field) follows the prefix, tokenized on its own as there
    with_prompt = infill_ids(qwen_tok, fim, PREFIX, SUFFIX, prompt="a")
    plain = qwen_tok.encode
    assert with_prompt[with_prompt.index(fim.pre) + 1:with_prompt.index(fim.suf)] == (
        plain(PREFIX, add_special=False) + plain("a", add_special=False))
    # code that spells a special token stays text
    ids = infill_ids(qwen_tok, fim, "x = '<|im_end|>'", "")
    assert qwen_tok.token_to_id("<|im_end|>") not in ids and ids.count(fim.mid) == 1


def test_infill_prompt_fits_its_budget(qwen_tok):
    fim = fim_tokens(qwen_tok)
    prefix = "".join(f"x{i} = {i}\n" for i in range(200))
    suffix = "".join(f"y{i} = {i}\n" for i in range(200))
    full = infill_ids(qwen_tok, fim, prefix, suffix, [("a.py", "z = 1\n" * 50)])
    for budget in (60, 200, 900):
        ids = infill_ids(qwen_tok, fim, prefix, suffix, [("a.py", "z = 1\n" * 50)], budget=budget)
        assert len(ids) == min(budget, len(full))
        p, s, m = ids.index(fim.pre), ids.index(fim.suf), ids.index(fim.mid)
        pre, suf = ids[p + 1:s], ids[s + 1:m]
        # what is kept is what lies next to the cursor: the prefix's end, the suffix's start
        enc = qwen_tok.encode(prefix, add_special=False, parse_special=False)
        assert pre == enc[len(enc) - len(pre):]
        assert suf == qwen_tok.encode(suffix, add_special=False, parse_special=False)[:len(suf)]
        assert len(suf) <= max(1, (budget - 3) // 4) or len(pre) == len(enc)
        assert ids[-1] == fim.mid
    with pytest.raises(ValueError):
        infill_ids(qwen_tok, fim, prefix, suffix, budget=3)


def test_server_fits_the_prompt_to_the_context(qwen_tok):
    """The routes' budget: the context less max tokens, or less a quarter of it (at most 256)
    where none is asked for, so the answer always has room."""
    from types import SimpleNamespace

    from luce.server.schema import infill_ids as server_ids
    state = SimpleNamespace(model=SimpleNamespace(tokenizer=qwen_tok, n_ctx=512), model_name="q")
    prefix = "".join(f"x{i} = {i}\n" for i in range(400))
    assert len(server_ids(state, prefix, "", max_tokens=100)) == 412
    assert len(server_ids(state, prefix, "", max_tokens=None)) == 384
    state.model.n_ctx = 4096
    assert len(server_ids(state, prefix * 4, "", max_tokens=None)) == 4096 - 256


@pytest.fixture(scope="module")
def qwen_server():
    import luce
    from luce.models.test_models import qwen_coder_05b_path
    from luce.server.app import create_app
    model = luce.load(qwen_coder_05b_path(), backend="cpu", n_ctx=512)
    with LiveServer(create_app(model, model_name="qwen")) as srv:
        yield srv


def test_completions_with_a_suffix_fill_in_the_middle(qwen_server, qwen_tok):
    oai = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="none", max_retries=0)
    r = oai.completions.create(model="qwen", prompt=PREFIX, suffix=SUFFIX, max_tokens=4, temperature=0)
    assert r.choices[0].text.startswith("a + b")
    # without a suffix the prompt is plain text again
    r = oai.completions.create(model="qwen", prompt=PREFIX, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(qwen_tok.encode(PREFIX))


def test_llama_cpp_infill_route(qwen_server):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4, "temperature": 0,
            "input_extra": [{"filename": "notes.txt", "text": "add two numbers\n"}]}
    r = httpx.post(qwen_server.url + "/infill", json=body, timeout=120).json()
    assert r["content"].startswith("a + b") and r["stop"] is True
    assert r["tokens_predicted"] == 4 and r["stop_type"] == "limit" and r["timings"]["predicted_n"] == 4
    with httpx.stream("POST", qwen_server.url + "/infill", json={**body, "stream": True}, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == r["content"]
    assert [e["stop"] for e in events][-1] is True and not any(e["stop"] for e in events[:-1])
    bad = httpx.post(qwen_server.url + "/infill", json={"input_prefix": 3}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input_prefix"
    bad = httpx.post(qwen_server.url + "/infill", json={"input_extra": ["x"]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input_extra[0]"


def test_a_model_without_fim_tokens_says_so(smollm2):
    from luce.server.app import create_app
    with LiveServer(create_app(smollm2, model_name="smollm2")) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "smollm2", "prompt": "a", "suffix": "b", "max_tokens": 1},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
        assert "fill-in-the-middle" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/infill", json={"input_prefix": "a"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_suffix"
        # and it still serves
        r = httpx.post(srv.url + "/v1/completions", json={"model": "smollm2", "prompt": "a", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
    smollm2.session.cache.truncate(0)  # the model is shared with other test files: leave its cache empty
    smollm2.session.tokens.clear()
