"""Opening model files: metadata, memory mapping, and one-line errors for bad files."""
import subprocess
import sys

import numpy as np
import pytest

from luce.errors import ModelFileError
from luce.gguf_file import GGUFFile


def test_metadata_and_memory_map(smollm2_path):
    f = GGUFFile(smollm2_path)
    assert f.architecture == "llama"
    assert f.get_int("llama.block_count") == 30
    assert f.get_float("llama.rope.freq_base") == 100000.0
    emb = f.tensor("token_embd.weight")
    assert emb.shape == (49152, 576) and emb.type_name == "Q8_0"
    # tensor bytes are views into the file's memory map, not copies
    base = emb.data
    while base.base is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap)
    with pytest.raises(ModelFileError, match="should be an integer"):
        f.get_int("general.name")


@pytest.fixture
def bad_files(tmp_path, smollm2_path):
    from luce.bench.synthetic import tiny, write_gguf
    import gguf
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as src:
        truncated.write_bytes(src.read(5_000_000))
    text = tmp_path / "notes.txt"
    text.write_text("this is not a model\n")
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(b"GGUF\x03\x00\x00\x00")
    unknown = write_gguf(tmp_path / "mamba.gguf", tiny("mamba9", 300),
                         types=lambda n: gguf.GGMLQuantizationType.F32)
    unsupported = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(unsupported), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 66), dtype=np.uint8), raw_shape=(4, 66),
                 raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return {"truncated": (truncated, "truncated|corrupt"), "text": (text, "not a GGUF file"),
            "header": (header_only, "corrupt"), "unknown": (unknown, "unsupported architecture 'mamba9'"),
            "unsupported": (unsupported, "unsupported type IQ2_XXS"),
            "missing": (tmp_path / "nope.gguf", "no such file")}


@pytest.mark.parametrize("kind", ["truncated", "text", "header", "unknown", "unsupported", "missing"])
@pytest.mark.parametrize("command", ["info", "generate"])
def test_cli_reports_bad_files_in_one_line(bad_files, kind, command):
    path, problem = bad_files[kind]
    args = [sys.executable, "-m", "luce.cli", command, str(path)]
    if command == "generate":
        args += ["hello", "--max-tokens", "2"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert str(path) in lines[0]
    import re
    assert re.search(problem, lines[0]), lines[0]
    assert "Traceback" not in r.stderr


def test_unknown_architecture_lists_known_ones(bad_files):
    import luce
    with pytest.raises(ModelFileError) as e:
        luce.load(bad_files["unknown"][0], backend="cpu")
    for arch in ("llama", "qwen2", "qwen3"):
        assert arch in str(e.value)
    assert "docs/plugins.md" in str(e.value)


def test_synthetic_model_loads_with_its_byte_tokenizer(tmp_path):
    """A random-weight GGUF written without another file's tokenizer carries a byte-level
    one: luce.load takes it, any text round-trips, and the last token ends text."""
    import luce
    from luce.bench.synthetic import tiny, write_gguf
    shape = tiny("qwen3", 300, n_layers=1, n_embd=64, n_ff=64, n_heads=2, n_kv_heads=1, head_dim=32)
    m = luce.load(write_gguf(tmp_path / "t.gguf", shape, types=_f32_types, seed=1), backend="cpu", n_ctx=32)
    text = "héllo wörld\n\t€"
    ids = m.tokenizer.encode(text)
    assert len(ids) == len(text.encode()) and max(ids) < 256
    assert m.tokenizer.decode(ids) == text
    assert m.tokenizer.eos_id == 299


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_synthetic_file_reads_the_config_its_gguf_does(tmp_path, arch):
    """A SyntheticFile (benchmark models made in memory) gives its family's read_config
    the same metadata a GGUF written from the same shape carries: equal configs."""
    from dataclasses import replace
    from luce.bench.synthetic import SyntheticFile, tiny, write_gguf
    from luce.gguf_file import GGUFFile
    from luce.plugins import family_for
    shape = replace(tiny(arch, 300, n_layers=6, n_embd=64, n_ff=64, n_heads=2, n_kv_heads=1, head_dim=32),
                    sliding_window=16 if arch == "gemma3" else None, tied_output=arch == "gemma3")
    f = GGUFFile(write_gguf(tmp_path / "t.gguf", shape, types=_f32_types, seed=1))
    mine, read = SyntheticFile(shape).config(), family_for(f.path, arch).read_config(f)
    assert read.rms_eps == pytest.approx(mine.rms_eps, rel=1e-6)  # the file stores float32
    assert replace(mine, rms_eps=0.0) == replace(read, rms_eps=0.0)


def _f32_types(name):
    import gguf
    return gguf.GGMLQuantizationType.F32


@pytest.mark.parametrize("keys,scale", [
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}, 0.25),
    ({"rope.scale_linear": 2.0}, 0.5),  # an older converter's key
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, 1.0),  # not linear: not applied here
    ({"rope.scaling.type": "none"}, 1.0),
    ({}, 1.0),
])
def test_linear_rope_scaling_from_metadata(keys, scale):
    from luce.bench.synthetic import SyntheticFile
    from luce.models.config import rope_freq_scale
    f = SyntheticFile("qwen3-0.6b")
    f.metadata.update({f"qwen3.{k}": v for k, v in keys.items()})
    assert rope_freq_scale(f) == scale
    f.metadata["qwen3.rope.scaling.factor"] = -2.0
    f.metadata["qwen3.rope.scaling.type"] = "linear"
    with pytest.raises(ModelFileError, match="rope.scaling.factor"):
        rope_freq_scale(f)


def test_load_a_synthetic_model(monkeypatch):
    """luce.load("synthetic:NAME"): random weights of a named shape made in memory, with a
    byte-level tokenizer, generating on the CPU backend; an unknown name is refused."""
    import luce
    from luce.bench import synthetic as S
    from luce.errors import LuceError
    monkeypatch.setitem(S.SHAPES, "qwen3-0.6b", S.tiny("qwen3", 300, n_layers=1, n_embd=32, n_ff=64, n_heads=2,
                                                        n_kv_heads=1, head_dim=16))
    m = luce.load("synthetic:qwen3-0.6b", backend="cpu", n_ctx=64)
    assert (m.config.n_layers, m.config.n_embd, m.config.vocab_size) == (1, 32, 300)
    assert m.tokenize("hi") == [ord("h"), ord("i")] and m.detokenize(m.tokenize("hé")) == "hé"
    out = m.generate("hi", max_tokens=3, temperature=0)
    assert out and out == m.generate("hi", max_tokens=3, temperature=0)  # greedy: the same again
    with pytest.raises(LuceError, match="unknown synthetic model"):
        luce.load("synthetic:nope", backend="cpu")


def test_synthetic_matrices_start_at_their_own_pool_rows(monkeypatch):
    """A synthetic model's matrices are tiled from one pool a (type, width), each from its
    own row (by name): its layers differ and gate is not up, and every matrix still
    repeats the pool's rows in order, wrapping."""
    import luce
    from luce.backends import tile_runs
    from luce.bench import synthetic as S
    monkeypatch.setitem(S.SHAPES, "qwen3-0.6b", S.tiny("qwen3", 300, n_layers=2, n_embd=256, n_ff=512, n_heads=2,
                                                        n_kv_heads=1, head_dim=128))
    m = luce.load("synthetic:qwen3-0.6b", backend="cpu", n_ctx=64)
    l0, l1 = m.weights.layers
    assert not np.array_equal(l0.wq, l1.wq) and not np.array_equal(l0.w_gate, l0.w_up)
    assert not np.array_equal(l0.w_gate, l1.w_gate)
    assert list(tile_runs(5, 12, 3)) == [(0, 3, 2), (2, 0, 5), (7, 0, 5)]
    assert list(tile_runs(5, 3, 7)) == [(0, 2, 3)]
