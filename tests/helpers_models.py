"""Tiny GGUF models whose greedy output is chosen by the test: "script" models.

A real GGUF (qwen3 architecture, SmolLM2's tokenizer, one layer) whose weights are built
by hand so that greedy decoding follows a table: the next token is a function of the
last two. The attention heads look exactly one position back (queries and keys are
constant vectors, pre-rotated so RoPE scores peak at offset 1) and copy the previous
token's one-hot "slot" into the residual stream; one feed-forward unit per (previous,
current) pair fires only when both match and writes the successor's slot; the output
head turns that slot into a logit peak. The model's own chat template ends the prompt
with a marker token picked from the conversation (the last message is a tool result,
the user asked for "[think]", ...), and each marker starts one script.

Decoding runs through the real forward, sampler, detokenizer, output parser and server,
so tool-call and reasoning tests are deterministic without faking any of them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

# SmolLM2's unused control tokens serve as markers (single ids the template can emit)
MARKERS = ["<repo_name>", "<reponame>", "<file_sep>", "<filename>", "<gh_stars>", "<issue_start>",
           "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>", "<jupyter_code>",
           "<jupyter_output>", "<jupyter_script>", "<empty_output>"]

TOOL_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}\n'
             '</tool_call>')
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>\n"
            "</tool_call>")
JSON_CALL = '{"name": "get_weather", "arguments": {"city": "Nice", "days": 5}}'
BAD_CALL = 'Checking.\n<tool_call>\n{"name": get_weather, oops}\n</tool_call>'
# the two calls are spelled differently: with six tokens of context, "</tool_call>" must
# be told apart by what precedes it
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
             '<tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>')
ANSWER = "It is sunny in Paris today."
THINK = "<think>\nThe user greets me. I should greet back.\n</think> Hi there, friend!"
TEXT = "Hello from the tiny model."
PONDER_OPEN = "<think>\n"
PONDER_LOOP = " hmm, let me ponder more carefully;"  # repeats until the budget closes it
TICK_LOOP = " tick tock"  # repeats until max_tokens, a timeout or a cancel

SCRIPTS = {
    "answer": ANSWER, "think": THINK, "xml": XML_CALL, "json": JSON_CALL, "bad": BAD_CALL,
    "tool": TOOL_CALL, "text": TEXT, "two": TWO_CALLS,
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}

TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}
{{- message.content }}
{%- for call in message.tool_calls or [] %}
{{- '<tool_call>\\n' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson + '\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if tools %}{{- '<|im_start|>system\\n<tools>' + tools | tojson + '</tools><|im_end|>\\n' }}{% endif %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- set last = messages[-1] %}
{%- set text = last.content if last.content is string else '' %}
{%- if last.role == 'tool' %}{{- M.answer }}
{%- elif '[think]' in text %}{{- M.think }}
{%- elif '[ponder]' in text %}{{- M.ponder }}
{%- elif '[tick]' in text %}{{- M.tick }}
{%- elif tools and '[xml]' in text %}{{- M.xml }}
{%- elif tools and '[json]' in text %}{{- M.json }}
{%- elif tools and '[bad]' in text %}{{- M.bad }}
{%- elif tools and '[two]' in text %}{{- M.two }}
{%- elif tools %}{{- M.tool }}
{%- else %}{{- M.text }}
{%- endif %}
{%- endif %}
"""



ROPE_BASE = 10.0  # many fast rotations: the score at the wanted offset stands well clear
HEAD_DIM = 64
ROPE_DIM = 32  # the rest of each head is not rotated: the marker heads match there, anywhere
QK_GAIN = 8.0  # q/k norm weights: ~60 logits between the wanted offset and its neighbours
GATE = 12.0  # feed-forward gate slope: silu(6) when a unit matches, ~0 otherwise (and no exp overflow)
LOGIT = 30.0  # the successor's logit; every other token gets 0
ORDER = 6  # the next token is a function of the script and this many last tokens


def _rules(tok, markers: dict[str, str]) -> dict[tuple[int, tuple[int, ...]], int]:
    """(marker, context of up to ORDER last tokens, oldest first) -> next token. A
    script's first steps see only the marker and what followed it, so what came before
    the marker never matters."""
    enc = lambda text: tok.encode(text, add_special=False, parse_special=False)  # noqa: E731
    rules: dict = {}
    eos = tok.eos_id

    def chain(marker: int, seq: list[int], anchor: int = 1):
        # seq[:anchor] is the context the script starts from
        for i in range(anchor, len(seq)):
            key = (marker, tuple(seq[max(0, i - ORDER):i]))
            if rules.setdefault(key, seq[i]) != seq[i]:
                raise ValueError(f"context {key} is followed by both {rules[key]} and {seq[i]}: change a script")

    for name, script in SCRIPTS.items():
        m = tok.token_to_id(markers[name])
        chain(m, [m] + enc(script) + [eos])
    m = tok.token_to_id(markers["ponder"])
    loop = enc(PONDER_LOOP)
    chain(m, [m] + enc(PONDER_OPEN) + loop * 3 + loop[:ORDER])
    # The engine closes an over-budget <think> with this text; the plain answer follows.
    close = enc("\n</think>\n\n")[-ORDER:]
    chain(m, close + enc(TEXT) + [eos], anchor=len(close))
    m = tok.token_to_id(markers["tick"])
    loop = enc(TICK_LOOP)
    chain(m, [m] + loop * 3 + loop[:ORDER])
    return rules


def build_script_model(path, smollm2_path) -> Path:
    """Write the script model to `path` (tens of MB, a few seconds)."""
    import gguf

    from luce.bench.synthetic import ModelShape
    from luce.gguf_file import GGUFFile
    from luce.text.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(GGUFFile(smollm2_path).metadata)
    vocab = tok.vocab_size
    names = list(SCRIPTS) + ["ponder", "tick"]
    markers = dict(zip(names, MARKERS))
    marker_ids = sorted(tok.token_to_id(m) for m in markers.values())
    rules = _rules(tok, markers)

    tokens = sorted({t for _, ctx in rules for t in ctx} | set(marker_ids))
    slot = {t: i + 1 for i, t in enumerate(tokens)}  # slot 0: every other token
    n_slots = len(tokens) + 1
    script = {m: i for i, m in enumerate(marker_ids)}
    succs = sorted(set(rules.values()))
    nxt = {t: i for i, t in enumerate(succs)}
    hd, half = HEAD_DIM, ROPE_DIM // 2
    per_group = -(-n_slots // hd)  # heads that carry one looked-back slot
    n_back = ORDER - 1
    n_heads = per_group * n_back + 1  # the last head finds the marker
    # residual stream: [bias | current slot | slot 1 back | ... | script | successor]
    blocks = [1 + i * n_slots for i in range(ORDER)]  # blocks[0]: current, blocks[k]: k back
    M = 1 + ORDER * n_slots
    N = M + len(marker_ids)
    d = N + len(succs)
    d += -d % 32
    n_units = len(rules)

    emb = np.zeros((vocab, d), dtype=np.float32)
    emb[:, 0] = 1.0
    emb[:, blocks[0]] = 1.0
    for t, s in slot.items():
        emb[t, blocks[0]] = 0.0
        emb[t, blocks[0] + s] = 1.0

    # Look-back heads: constant q and k from the bias dimension, q pre-rotated by k
    # positions so that RoPE scores peak at offset k. Values carry the token's slot (after
    # the norm h = x * sqrt(d/2)); the output writes it into the k-back block.
    theta = ROPE_BASE ** (-np.arange(0, ROPE_DIM, 2) / ROPE_DIM)
    wq = np.zeros((n_heads * hd, d), dtype=np.float32)
    wk = np.zeros((n_heads * hd, d), dtype=np.float32)
    wv = np.zeros((n_heads * hd, d), dtype=np.float32)
    wo = np.zeros((d, n_heads * hd), dtype=np.float32)
    v_scale = 1.0 / np.sqrt(d / 2)
    for g in range(n_back):
        back = g + 1
        for h in range(g * per_group, (g + 1) * per_group):
            wq[h * hd:h * hd + half, 0] = np.cos(back * theta)
            wq[h * hd + half:h * hd + ROPE_DIM, 0] = -np.sin(back * theta)
            wk[h * hd:h * hd + half, 0] = 1.0
        for s in range(n_slots):
            row = g * per_group * hd + s
            wv[row, blocks[0] + s] = v_scale
            wo[blocks[back] + s, row] = 1.0
    # The marker head matches in the unrotated dims, where only marker tokens have a key,
    # so it finds the prompt's one marker however far back: the script being played.
    mh = (n_heads - 1) * hd
    wq[mh + ROPE_DIM:mh + hd, 0] = 1.0
    for m, i in script.items():
        wk[mh + ROPE_DIM:mh + hd, blocks[0] + slot[m]] = 1.0
        wv[mh + i, blocks[0] + slot[m]] = v_scale
        wo[M + i, mh + i] = 1.0

    # feed-forward: one unit per rule, firing when the script and the whole context match
    # (after the norm, h = x * sqrt(d / (ORDER + 2)): bias, one slot per block, script)
    sk = np.sqrt(d / (ORDER + 2))
    wg = np.zeros((n_units, d), dtype=np.float32)
    wu = np.zeros((n_units, d), dtype=np.float32)
    wd = np.zeros((d, n_units), dtype=np.float32)
    wu[:, 0] = 1.0 / sk
    for u, ((m, ctx), t) in enumerate(rules.items()):
        wg[u, M + script[m]] = GATE / sk
        for back, tid in enumerate(reversed(ctx)):
            wg[u, blocks[back] + slot[tid]] = GATE / sk
        wg[u, 0] = -(len(ctx) + 0.5) * GATE / sk
        wd[N + nxt[t], u] = 2.0 / GATE
    # output: the successor block (after the norm h = x * sqrt(d / (ORDER + 3)))
    head = np.zeros((vocab, d), dtype=np.float32)
    for t, i in nxt.items():
        head[t, N + i] = LOGIT / np.sqrt(d / (ORDER + 3))

    tensors = {
        "token_embd.weight": emb.astype(np.float16), "output.weight": head.astype(np.float16),
        "output_norm.weight": np.ones(d, np.float32),
        "blk.0.attn_norm.weight": np.ones(d, np.float32), "blk.0.ffn_norm.weight": np.ones(d, np.float32),
        "blk.0.attn_q_norm.weight": np.full(hd, QK_GAIN, np.float32),
        "blk.0.attn_k_norm.weight": np.full(hd, QK_GAIN, np.float32),
        "blk.0.attn_q.weight": wq, "blk.0.attn_k.weight": wk, "blk.0.attn_v.weight": wv,
        "blk.0.attn_output.weight": wo, "blk.0.ffn_gate.weight": wg, "blk.0.ffn_up.weight": wu,
        "blk.0.ffn_down.weight": wd,
    }
    shape = ModelShape("qwen3", n_layers=1, n_embd=d, n_ff=n_units, n_heads=n_heads, n_kv_heads=n_heads,
                       head_dim=hd, vocab_size=vocab, n_ctx_train=4096, rope_base=ROPE_BASE)
    assert set(shape.tensor_shapes()) == set(tensors)
    template = TEMPLATE
    for name, m in markers.items():
        template = template.replace("M." + name + " ", repr(m) + " ")

    path = Path(path)
    w = gguf.GGUFWriter(str(path), "qwen3")
    for key, val in (("block_count", 1), ("context_length", shape.n_ctx_train), ("embedding_length", d),
                     ("feed_forward_length", n_units), ("attention.head_count", n_heads),
                     ("attention.head_count_kv", n_heads), ("attention.key_length", hd),
                     ("attention.value_length", hd)):
        w.add_uint32(f"qwen3.{key}", val)
    w.add_float32("qwen3.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("qwen3.rope.freq_base", ROPE_BASE)
    w.add_uint32("qwen3.rope.dimension_count", ROPE_DIM)
    w.add_string("general.name", "luce-script-model")

    reader = gguf.GGUFReader(str(smollm2_path))
    for f in reader.fields.values():
        # SmolLM2's tokenizer, without its chat template
        if f.name.startswith("tokenizer.") and f.name != "tokenizer.chat_template":
            vtype = gguf.GGUFValueType(f.types[0])
            sub = gguf.GGUFValueType(f.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(f.name, f.contents(), vtype, sub)
    w.add_string("tokenizer.chat_template", template)
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def script_model_path(smollm2_path) -> Path:
    """The script model, built once per version of this file into luce's cache."""
    import hashlib

    from luce.models.bundled import cache_dir

    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    path = cache_dir() / f"luce-script-model-{digest}.gguf"
    if not path.is_file():
        tmp = path.with_suffix(".part")
        build_script_model(tmp, smollm2_path)
        tmp.replace(path)
    return path


class LiveServer:
    """A luce app served by uvicorn on a loopback port, in a thread of the test process."""

    def __init__(self, app):
        import socket
        import threading

        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        import time
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > 30 or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()

    @property
    def state(self):
        return self.app.state.luce
