"""luce's CPU backend against Hugging Face transformers loading the same GGUF weights.

Slow (torch, float32 weights): `pip install -e ".[oracle]"` then
`pytest -m oracle tests/test_oracle_transformers.py`.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.oracle

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years, "
    "presses were operating in more than two hundred European cities, and the price of books fell "
    "sharply. def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n"
)


def hf_model(path, **kw):
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32, **kw)
    return m.eval()


def compare(path, ids, hf_kwargs=None, n_generate=64, n_ctx=512):
    import torch
    import luce
    model = luce.load(path, backend="cpu", n_ctx=n_ctx)
    hf = hf_model(path, **(hf_kwargs or {}))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    session = model.new_session()
    ours = session.forward(ids)  # every row's logits from one causal pass
    rel = np.linalg.norm(ours - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert rel.max() < 1e-3, f"max relative L2 error {rel.max():.2e}"
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() == 1.0

    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=n_generate, do_sample=False,
                             min_new_tokens=n_generate)[0, len(ids):].tolist()
    ours_out = [d for delta in model.stream(ids, max_tokens=n_generate, temperature=0, ignore_eos=True)
                for d in delta.token_ids]
    assert ours_out == hf_out
    return rel.max()


def real_ids(path, n=72, text=TEXT):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tok(text)["input_ids"]
    assert len(ids) >= n
    return ids[:n]


def test_smollm2_matches_transformers(smollm2_path):
    compare(smollm2_path, real_ids(smollm2_path))


def test_qwen_coder_05b_matches_transformers():
    from luce.models.test_models import qwen_coder_05b_path
    path = qwen_coder_05b_path()
    compare(path, real_ids(path))


def test_random_qwen3_matches_transformers(tmp_path, smollm2_path):
    import gguf
    from luce.bench.synthetic import tiny, write_gguf
    Q = gguf.GGMLQuantizationType
    shape = tiny("qwen3", 49152, n_layers=3, n_embd=128, n_ff=256, n_heads=4, n_kv_heads=2, head_dim=32)
    # a mix of types: float norms, Q8_0 and F16 matrices
    types = lambda n: Q.F32 if "norm" in n else (Q.Q8_0 if "ffn" in n or "attn_q." in n else Q.F16)
    path = write_gguf(tmp_path / "qwen3-tiny.gguf", shape, types=types, seed=1, tokenizer_from=smollm2_path)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 49152, size=80).tolist()
    compare(path, ids, hf_kwargs={"head_dim": 32})


def test_gemma3_270m_matches_transformers():
    """Past its 512-token sliding window too (5 windowed layers a global one), and the
    figures tests/test_gemma3.py checks without torch are what transformers computes."""
    import json
    from pathlib import Path
    import torch
    from luce.models.test_models import gemma3_270m_path
    path = gemma3_270m_path()
    compare(path, real_ids(path))
    long_ids = real_ids(path, n=600, text=TEXT * 7)
    compare(path, long_ids, n_generate=16, n_ctx=1024)
    rec = json.loads((Path(__file__).parent / "data" / "gemma3_270m_transformers.json").read_text())
    hf = hf_model(path)
    with torch.no_grad():
        assert hf(torch.tensor([rec["long_ids"]])).logits[0].argmax(-1).tolist() == rec["long_argmax"]
        p = rec["greedy_prompt"]
        out = hf.generate(torch.tensor([p]), max_new_tokens=len(rec["greedy_tokens"]), do_sample=False)[0, len(p):]
    assert out.tolist() == rec["greedy_tokens"]


def test_random_gemma3_large_size_rules_match_transformers(tmp_path, smollm2_path):
    """Gemma 3's 4B-27B numerics, which Gemma-3-270M lacks, on a tiny random model:
    linear RoPE scaling (factor 8, from the file) in the global layers only, and at 62 layers
    27B's attention scale 1/sqrt(n_embd / n_heads) (transformers' query_pre_attn_scalar;
    its GGUF loader reads neither, so they are passed to it), past a 16-token window."""
    import gguf
    from luce.bench.synthetic import tiny, write_gguf
    Q = gguf.GGMLQuantizationType
    shape = tiny("gemma3", 49152, n_layers=62, n_embd=128, n_ff=256, n_heads=4, n_kv_heads=2, head_dim=64,
                 sliding_window=16, rope_scaling=8.0, rope_base=1e6, tied_output=True)
    path = write_gguf(tmp_path / "gemma3-tiny.gguf", shape, types=lambda n: Q.F32 if "norm" in n else Q.Q8_0,
                      seed=3, tokenizer_from=smollm2_path)
    ids = np.random.default_rng(4).integers(0, 49152, size=60).tolist()
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    compare(path, ids, n_generate=8, hf_kwargs={"rope_parameters": rope, "query_pre_attn_scalar": 128 // 4})
