"""Decode speed through a running server's OpenAI API, to set beside `luce bench`:

    python -m luce.bench.api_client http://127.0.0.1:8000

One greedy non-streaming chat completion (256 tokens, EOS ignored) reports the server's
own timings; the same request streamed gives chunks and time to first chunk; 8 clients at
once check that every response completes. Prints one JSON object."""
from __future__ import annotations

import json
import sys
import threading
import time


def run(base: str, max_tokens: int = 256, clients: int = 8) -> dict:
    import httpx
    c = httpx.Client(base_url=base, timeout=600)
    model = c.get("/v1/models").json()["data"][0]["id"]
    msgs = [{"role": "user", "content": "Write a long story about a robot who learns to paint."}]
    body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = c.post("/v1/chat/completions", json=body).json()
    out = {"model": model, "usage": r["usage"], "timings": r.get("timings")}
    t0, first, chunks = time.perf_counter(), None, 0
    with c.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                d = json.loads(line[6:])
                if d.get("choices") and d["choices"][0]["delta"].get("content"):
                    chunks += 1
                    first = first or time.perf_counter()
    out["stream"] = {"chunks": chunks, "wall_s": time.perf_counter() - t0, "first_chunk_s": (first or t0) - t0}
    done = [None] * clients

    def one(i):
        rr = c.post("/v1/chat/completions", json={"model": model, "max_tokens": 64, "temperature": 0,
                                                  "messages": [{"role": "user", "content": f"Count to {i + 5}."}]})
        done[i] = rr.json()["usage"]["completion_tokens"]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["concurrent"] = {"completion_tokens": done, "wall_s": time.perf_counter() - t0}
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"), indent=1))
