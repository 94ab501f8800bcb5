"""`luce serve` as a user runs it: a separate process, an API key, a model name, a chat
template file, a context limit."""
import os
import signal
import socket
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

from helpers_models import ANSWER, MARKERS, TEMPLATE, script_model_path

KEY = "sekret-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(smollm2_path, tmp_path_factory):
    path = script_model_path(smollm2_path)
    # the template override always plays the "answer" script: proof that it is the one in use
    tpl = tmp_path_factory.mktemp("tpl") / "answer.jinja"
    tpl.write_text(TEMPLATE.split("{%- if add_generation_prompt %}")[0]
                   + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n" + MARKERS[0] + "' }}{% endif %}\n")
    port = _free_port()
    cmd = [sys.executable, "-m", "luce.cli", "serve", str(path), "--port", str(port), "--backend", "cpu",
           "--api-key", KEY, "--model-name", "scripted", "--max-ctx", "1024", "--chat-template-file", str(tpl),
           "--kv-slots", "2", "--spec", "lookup", "--log-level", "warning"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            raise RuntimeError("luce serve exited:\n" + proc.stdout.read())
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() - t0 > 120:
            proc.kill()
            raise RuntimeError("luce serve did not open its port")
        time.sleep(0.2)
    yield url, proc
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_api_key_is_required(served):
    url, _ = served
    for key in (None, "wrong"):
        headers = {"authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(url + "/v1/chat/completions", json={"model": "scripted", "messages": []}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="scripted", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error"
    assert httpx.get(url + "/health").status_code == 200  # health needs no key


def test_serves_with_key_name_template_and_context(served):
    url, _ = served
    oai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in oai.models.list().data] == ["scripted"]
    r = oai.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}], temperature=0)
    assert r.choices[0].message.content == ANSWER
    ant = anthropic.Anthropic(base_url=url, auth_token=None, api_key=KEY, max_retries=0)
    m = ant.messages.create(model="scripted", max_tokens=50, messages=[{"role": "user", "content": "hi"}])
    assert m.content[0].text == ANSWER
    props = httpx.get(url + "/props", headers={"authorization": f"Bearer {KEY}"}).json()
    assert props["model"] == "scripted" and props["n_ctx"] == 1024
    assert props["runtime"]["api_key_required"] is True and props["runtime"]["chat_template_file"].endswith(".jinja")
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}], max_tokens=1020)
    assert e.value.status_code == 413
    # speculative decoding (prompt lookup) is in force and reported
    assert props["draft"]["mode"] == "lookup"
    metrics = httpx.get(url + "/metrics").text.splitlines()
    (gauge,) = [line for line in metrics if line.startswith("luce_speculative_acceptance_length ")]
    assert float(gauge.split()[1]) > 0
    for name in ("luce_speculative_draft_seconds_total ", "luce_speculative_verify_seconds_total "):
        (line,) = [m for m in metrics if m.startswith(name)]
        assert float(line.split()[1]) > 0, line
    # and each response's timings carry them (llama.cpp-style field names beside acceptance)
    raw = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                     json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "temperature": 0})
    t = raw.json()["timings"]
    assert t["acceptance_length"] > 0 and t["verify_ms"] > 0 and t["draft_ms"] >= 0


def test_kv_slots_keep_two_conversations_cached(served):
    url, _ = served
    oai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    a = [{"role": "user", "content": "the first conversation, " * 20}]
    b = [{"role": "user", "content": "another one entirely; " * 20}]
    for msgs in (a, b):
        oai.chat.completions.create(model="scripted", messages=msgs, temperature=0)
    r = oai.chat.completions.create(model="scripted", messages=a, temperature=0)
    # the second conversation took the other slot: the first one's cache is intact
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


def test_bad_options_fail_cleanly():
    r = subprocess.run([sys.executable, "-m", "luce.cli", "serve", "/nonexistent/model.gguf", "--backend", "cpu"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "luce: error:" in r.stderr and "Traceback" not in r.stderr
