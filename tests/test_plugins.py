"""The model-family registry: built-in families, a real third-party plugin
(tests/plugins/luce-example-plugin, pip-installed into a temporary directory), broken
plugins reported by name, LUCE_PLUGINS, family validation, drafts, kernels, commands."""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

import luce.plugins as plugins
from luce.errors import UnknownArchitectureError
from luce.models.family import (ChatFormat, DraftModel, DraftSpec, DraftUnavailableError, FamilyDeclarationError,
                                ModelFamily, Optimizations, find_local_gguf)

PLUGIN_SRC = Path(__file__).parent / "plugins" / "luce-example-plugin"
PLUGIN_DIST = "luce-example-plugin"
PLUGIN_MODULE = "luce_example_plugin"


# -- installing the example plugin -------------------------------------------------------

def _install_plugin(src: Path, work: Path) -> Path:
    """pip-install the plugin package into work/site (nothing outside work changes) and
    return that directory: on sys.path it makes the package and its dist-info (so its
    entry point) visible. Offline when setuptools is importable (--no-build-isolation);
    otherwise pip fetches the build backend from PyPI. Without pip (a uv venv), the same
    layout is written by hand."""
    tree = work / "src"
    shutil.copytree(src, tree, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = work / "site"
    import importlib.util
    if importlib.util.find_spec("pip") is None:
        return _install_by_hand(tree, site)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
           "--no-compile", "--target", str(site)]
    if importlib.util.find_spec("setuptools") is not None:
        cmd += ["--no-build-isolation", "--no-index"]
    # pip settings that conflict with --target (a user install, another prefix) are dropped
    env = {k: v for k, v in os.environ.items()
           if k not in ("PIP_USER", "PIP_TARGET", "PIP_PREFIX", "PIP_ROOT", "PIP_REQUIRE_VIRTUALENV")}
    r = subprocess.run(cmd + [str(tree)], capture_output=True, text=True, timeout=300, env=env)
    if r.returncode != 0:
        warnings.warn(f"pip could not install the example plugin ({r.stderr.strip()[-400:]}); "
                      "installing it by hand instead")
        shutil.rmtree(site, ignore_errors=True)
        return _install_by_hand(tree, site)
    return site


def _install_by_hand(tree: Path, site: Path) -> Path:
    meta = tomllib.loads((tree / "pyproject.toml").read_text())["project"]
    site.mkdir(parents=True)
    for pkg in tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]:
        shutil.copytree(tree / pkg, site / pkg)
    dist_info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    eps = meta.get("entry-points", {})
    (dist_info / "entry_points.txt").write_text(
        "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in e.items()) for g, e in eps.items()))
    return site


def _fake_dist(site: Path, dist: str, module: str, source: str, entry_point: str | None = None) -> None:
    """An installed distribution in `site`: a module and a dist-info with a `luce` entry point."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[luce]\n{entry_point or dist} = {module}\n")


BAD_DECLARATION = '''
from luce.models.config import ROPE_HALVES, read_config
from luce.models.family import ModelFamily
from luce.plugins import hookimpl

def cfg(f):
    return read_config(f, rope_style=ROPE_HALVES)

@hookimpl
def register_model_families(register):
    register(ModelFamily(name="badlm", architectures=("badlm",), read_config=cfg,
                         optimizations={"ddtree_budget": 0}))
    register(ModelFamily(name="goodlm", architectures=("goodlm",), read_config=cfg))

@hookimpl
def register_model_family(register):  # a misspelt hook: reported, the rest of the plugin loads
    pass

@hookimpl
def register_commands(cli):
    @cli.command("info")
    def hijack():
        pass
'''

BROKEN_IMPORT = "import luce_nonexistent_dependency  # noqa\n"


@pytest.fixture(scope="session")
def example_site(tmp_path_factory) -> Path:
    return _install_plugin(PLUGIN_SRC, tmp_path_factory.mktemp("example-plugin"))


@pytest.fixture(scope="session")
def broken_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("broken-plugins") / "site"
    _fake_dist(site, "luce-bad-declaration", "luce_bad_declaration", BAD_DECLARATION)
    _fake_dist(site, "luce-broken-import", "luce_broken_import", BROKEN_IMPORT, entry_point="broken")
    return site


class _Sites:
    """Puts site directories on sys.path (as if installed) and reloads the plugins."""

    def __init__(self, monkeypatch):
        self.mp = monkeypatch
        self.added: list[str] = []

    def add(self, *sites: Path) -> None:
        for s in sites:
            self.added.append(str(s))
            sys.path.insert(0, str(s))
        plugins.reset()

    def close(self) -> None:
        for s in self.added:
            while s in sys.path:
                sys.path.remove(s)
        for name in [m for m in sys.modules if m.split(".")[0] in
                     (PLUGIN_MODULE, "luce_bad_declaration", "luce_broken_import")]:
            del sys.modules[name]
        plugins.reset()


@pytest.fixture
def sites(monkeypatch):
    monkeypatch.delenv("LUCE_PLUGINS", raising=False)
    s = _Sites(monkeypatch)
    plugins.reset()
    yield s
    s.close()


@pytest.fixture
def cli_main():
    """luce's click group, with any commands the test's plugins add removed afterwards."""
    from luce.cli import main
    before = dict(main.commands)
    core = getattr(main, "_luce_core_commands", None)
    yield main
    main.commands.clear()
    main.commands.update(before)
    if core is None and hasattr(main, "_luce_core_commands"):
        del main._luce_core_commands


# -- a tiny examplelm GGUF -----------------------------------------------------------------

def write_examplelm(path: Path, tokenizer_from: Path, n_layers=2, n_embd=64, n_heads=4, n_kv=2, n_ff=128,
                    seed=0) -> Path:
    """Random weights for the example plugin's `examplelm` architecture (q/k/v bias,
    per-head q/k norm, tied output), with SmolLM2's tokenizer metadata copied over."""
    import gguf
    arch, hd = "examplelm", n_embd // n_heads
    src = gguf.GGUFReader(str(tokenizer_from))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.name", "ExampleLM Tiny")
    w.add_uint32(f"{arch}.block_count", n_layers)
    w.add_uint32(f"{arch}.context_length", 512)
    w.add_uint32(f"{arch}.embedding_length", n_embd)
    w.add_uint32(f"{arch}.feed_forward_length", n_ff)
    w.add_uint32(f"{arch}.attention.head_count", n_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", n_kv)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    for key, fl in src.fields.items():
        if key.startswith("tokenizer."):
            t = fl.types
            w.add_key_value(key, fl.contents(), t[0], sub_type=t[1] if len(t) > 1 else None)
    rng = np.random.default_rng(seed)
    r = lambda *shape, s=0.05: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    norm = lambda n: (1.0 + r(n, s=0.1)).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", r(vocab, n_embd, s=0.5))
    for i in range(n_layers):
        p = f"blk.{i}."
        for name, t in [("attn_norm.weight", norm(n_embd)), ("attn_q.weight", r(n_heads * hd, n_embd)),
                        ("attn_k.weight", r(n_kv * hd, n_embd)), ("attn_v.weight", r(n_kv * hd, n_embd)),
                        ("attn_q.bias", r(n_heads * hd)), ("attn_k.bias", r(n_kv * hd)), ("attn_v.bias", r(n_kv * hd)),
                        ("attn_q_norm.weight", norm(hd)), ("attn_k_norm.weight", norm(hd)),
                        ("attn_output.weight", r(n_embd, n_heads * hd)), ("ffn_norm.weight", norm(n_embd)),
                        ("ffn_gate.weight", r(n_ff, n_embd)), ("ffn_up.weight", r(n_ff, n_embd)),
                        ("ffn_down.weight", r(n_embd, n_ff))]:
            w.add_tensor(p + name, t)
    w.add_tensor("output_norm.weight", norm(n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def examplelm_gguf(tmp_path_factory, smollm2_path) -> Path:
    return write_examplelm(tmp_path_factory.mktemp("examplelm") / "examplelm-tiny.gguf", smollm2_path)


# -- built-ins -----------------------------------------------------------------------------

def test_builtin_families_register_through_the_hooks(sites, monkeypatch):
    monkeypatch.setenv("LUCE_PLUGINS", "none")
    plugins.reset()
    fams = plugins.families()
    assert {"llama", "qwen2", "qwen3"} <= set(fams)
    assert all(fams[a].plugin == "luce" for a in ("llama", "qwen2", "qwen3"))
    # the built-in plugin is an ordinary pluggy plugin implementing the public hooks
    pm = plugins.plugin_manager()
    assert [i.plugin_name for i in pm.hook.register_model_families.get_hookimpls()] == ["luce"]
    assert plugins.problems() == []
    assert fams["qwen2"].read_config.__name__ == "qwen2_config"
    assert isinstance(fams["qwen3"].optimizations, Optimizations)
    assert fams["qwen3"].optimizations["ddtree_budget"] == 22
    assert fams["qwen3"].sampling_defaults["temperature"] == 0.6


def test_unknown_architecture_lists_known_ones_and_points_to_the_docs(sites):
    with pytest.raises(UnknownArchitectureError) as e:
        plugins.family_for("x.gguf", "mamba9")
    msg = str(e.value)
    assert "'mamba9'" in msg and "llama, qwen2, qwen3" in msg and "docs/plugins.md" in msg


class _Meta:
    """Stands in for a GGUFFile in draft matching: general.* metadata and a path."""

    def __init__(self, basename, size, name="x"):
        self.md = {"general.basename": basename, "general.size_label": size, "general.name": name}
        self.path = Path(f"/m/{name}.gguf")

    def get(self, k, default=None):
        return self.md.get(k, default)


def test_qwen_drafts_pair_with_the_larger_sizes(sites):
    fams = plugins.families()
    q2, q3 = fams["qwen2"], fams["qwen3"]
    names = lambda fam, f: [d.label for d in fam.drafts_for(f) if d.kind == "model"]  # noqa: E731
    assert names(q2, _Meta("Qwen2.5-Coder", "1.5B")) == ["Qwen2.5-Coder-0.5B-Instruct"]
    assert names(q2, _Meta("Qwen2.5-Coder", "0.5B")) == []
    assert names(q2, _Meta("Qwen2.5", "7B")) == []  # not a coder model: different draft
    assert names(q3, _Meta("Qwen3", "1.7B")) == ["Qwen3-0.6B"]
    assert names(q3, _Meta("Qwen3", "8B")) == ["Qwen3-0.6B", "Qwen3-1.7B"]
    assert names(q3, _Meta("Qwen3", "0.6B")) == []
    assert all(d.kind == "lookup" for d in q3.drafts_for(_Meta("Qwen3", "0.6B")))


def test_drafts_resolve_lazily_and_say_when_missing(sites, tmp_path, monkeypatch):
    for env in ("LUCE_CACHE", "LUCE_MODEL_CACHE", "HF_HOME"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("LUCE_DRAFT_DIR", str(tmp_path / "drafts"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    q3 = plugins.families()["qwen3"]
    d06 = next(d for d in q3.drafts if d.label == "Qwen3-0.6B")
    assert isinstance(d06.model, DraftModel)
    with pytest.raises(DraftUnavailableError, match=r"Qwen3-0\.6B is not available.*LUCE_DRAFT_DIR"):
        d06.resolve()
    (tmp_path / "drafts").mkdir()
    gguf = tmp_path / "drafts" / "Qwen3-0.6B-Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert d06.resolve() == gguf
    # a resolver that raises is reported with its reason
    missing = DraftSpec(kind="model", model=DraftModel("X", find_local_gguf("nope*.gguf")))
    with pytest.raises(DraftUnavailableError, match="draft model X"):
        missing.resolve()
    assert DraftSpec(kind="lookup").resolve() is None


# -- validation ----------------------------------------------------------------------------

def _cfg(f):
    raise AssertionError("not called")


GOOD = ModelFamily(name="okfam", architectures=("oklm",), read_config=_cfg)


@pytest.mark.parametrize("changes, field", [
    ({"name": "Bad Name"}, "name"),
    ({"architectures": "oklm"}, "architectures"),
    ({"architectures": ()}, "architectures"),
    ({"architectures": ("oklm", 3)}, "architectures[1]"),
    ({"read_config": None}, "read_config"),
    ({"forward": 42}, "forward"),
    ({"chat_format": ChatFormat(tool_call_format="xml-ish")}, "chat_format.tool_call_format"),
    ({"chat_format": ChatFormat(reasoning_markers=("<think>",))}, "chat_format.reasoning_markers"),
    ({"sampling_defaults": {"temprature": 0.5}}, "sampling_defaults.temprature"),
    ({"sampling_defaults": {"top_p": 0}}, "sampling_defaults"),
    ({"sampling_defaults": {"top_k": "20"}}, "sampling_defaults.top_k"),
    ({"drafts": DraftSpec(kind="lookup")}, "drafts"),
    ({"drafts": (DraftSpec(kind="medusa"),)}, "drafts[0].kind"),
    ({"drafts": (DraftSpec(kind="lookup"), DraftSpec(kind="model"))}, "drafts[1].model"),
    ({"drafts": (DraftSpec(kind="model", model="a.gguf", targets="qwen*"),)}, "drafts[0].targets"),
    ({"optimizations": {"ddtree_budget": 0}}, "optimizations.ddtree_budget"),
    ({"optimizations": {"tree_budget": 8}}, "optimizations.tree_budget"),
    ({"optimizations": {"prefill_compression": 1.5}}, "optimizations.prefill_compression"),
    ({"optimizations": {"kv_types": ("f16", "q3")}}, "optimizations.kv_types"),
    ({"optimizations": {"kv_paging": "yes"}}, "optimizations.kv_paging"),
    ({"optimizations": {"kv_page_size": 0}}, "optimizations.kv_page_size"),
    ({"optimizations": [("ddtree_budget", 4)]}, "optimizations"),
])
def test_validation_names_the_field(changes, field):
    with pytest.raises(FamilyDeclarationError) as e:
        dataclasses.replace(GOOD, **changes).validate()
    assert e.value.field == field
    assert f"field {field!r}" in str(e.value)


def test_validation_normalizes_a_good_declaration():
    fam = dataclasses.replace(GOOD, architectures=["oklm", "oklm2"], optimizations={"ddtree_budget": 4,
                                                                                    "kv_types": ["q8_0", "f16"]},
                              drafts=[DraftSpec(kind="model", model=lambda: None, targets=["oklm-7b*"])]).validate()
    assert fam.architectures == ("oklm", "oklm2")
    assert fam.optimizations == Optimizations(ddtree_budget=4, kv_types=("q8_0", "f16"))
    assert fam.drafts[0].targets == ("oklm-7b*",)


# -- the third-party example plugin --------------------------------------------------------

def test_example_plugin_registers_its_family(sites, example_site):
    sites.add(example_site)
    fam = plugins.families()["examplelm"]
    assert fam.plugin == PLUGIN_DIST  # filled in by the manager from the distribution
    assert fam.name == "examplelm" and fam.optimizations.ddtree_budget == 8
    assert {"llama", "qwen2", "qwen3"} <= set(plugins.families())
    info = next(p for p in plugins.plugins() if p.dist == PLUGIN_DIST)
    assert info.name == "example" and info.version == "0.1.0" and info.loaded
    assert plugins.problems() == []


def test_example_plugin_model_loads_and_generates(sites, example_site, examplelm_gguf):
    sites.add(example_site)
    import luce
    m = luce.load(examplelm_gguf, backend="cpu")
    assert m.family.name == "examplelm" and m.family.plugin == PLUGIN_DIST
    assert m.config.qkv_bias and m.config.qk_norm and m.config.n_layers == 2 and m.config.n_embd == 64
    assert m.sampling_params().temperature == 0.7  # the family's default sampling
    calls = importlib.import_module(PLUGIN_MODULE).calls
    before = calls["swiglu"]
    deltas = list(m.stream("The capital of France is", max_tokens=6, temperature=0, ignore_eos=True))
    ids = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    assert len(ids) == 6 and deltas[-1].finish_reason == "length"
    assert deltas[-1].stats.completion_tokens == 6
    assert calls["swiglu"] - before >= 6 * 2  # the plugin's kernel ran in every layer
    assert m.detokenize(ids) == text
    again = m.generate("The capital of France is", max_tokens=6, temperature=0, ignore_eos=True,
                       session=m.new_session())
    assert again == text  # greedy: deterministic


def test_example_plugin_kernel_override(sites, example_site):
    sites.add(example_site)
    from luce.backends.cpu import NumpyOps
    from luce.kernels.activation import swiglu_ref
    mod = importlib.import_module(PLUGIN_MODULE)
    assert plugins.kernels("examplelm", "swiglu", "cpu") is mod.swiglu
    assert plugins.kernels("llama", "swiglu", "cpu") is swiglu_ref
    assert plugins.kernels("examplelm", "rope", "cpu") is NumpyOps.rope
    assert plugins.kernels("examplelm", "swiglu", "cuda") is None
    ops = plugins.ops_with_overrides(NumpyOps, "examplelm", "cpu")
    assert ops.swiglu is mod.swiglu and ops.rms_norm is NumpyOps.rms_norm
    assert plugins.ops_with_overrides(NumpyOps, "qwen3", "cpu") is NumpyOps
    cfg = types.SimpleNamespace(arch="examplelm")  # a backend has the ModelConfig at hand
    assert plugins.kernels(cfg, "swiglu", "cpu") is mod.swiglu
    g, u = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)
    np.testing.assert_allclose(ops.swiglu(g, u), swiglu_ref(g, u), rtol=1e-5, atol=1e-6)


def test_families_command_and_plugin_command(sites, example_site, cli_main):
    from click.testing import CliRunner
    sites.add(example_site)
    runner = CliRunner()
    r = runner.invoke(cli_main, ["families"])
    assert r.exit_code == 0, r.output
    assert f"examplelm  (from {PLUGIN_DIST} 0.1.0)" in r.output and "qwen3  (from luce" in r.output
    assert "ddtree_budget=8" in r.output and "model Qwen3-0.6B" in r.output
    data = json.loads(runner.invoke(cli_main, ["families", "--json"]).output)
    fam = {f["name"]: f for f in data["families"]}
    assert fam["examplelm"]["architectures"] == ["examplelm"] and fam["examplelm"]["plugin"] == PLUGIN_DIST
    assert fam["qwen2"]["drafts"][0]["name"] == "Qwen2.5-Coder-0.5B-Instruct"
    assert "swiglu@cpu" in fam["examplelm"]["kernels"]
    r = runner.invoke(cli_main, ["example-hello", "--name", "tests"])
    assert r.exit_code == 0 and r.output.strip() == "hello tests from luce-example-plugin"


def test_info_in_a_fresh_interpreter_finds_the_plugin(example_site, examplelm_gguf, monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "LUCE_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(example_site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    r = subprocess.run([sys.executable, "-m", "luce.cli", "info", str(examplelm_gguf)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"examplelm (family 'examplelm' from {PLUGIN_DIST})" in r.stdout
    assert "ddtree_budget=8" in r.stdout and "temperature=0.7" in r.stdout


# -- broken plugins, LUCE_PLUGINS ------------------------------------------------------------

def test_broken_plugins_are_reported_by_name_and_the_rest_works(sites, example_site, broken_site, examplelm_gguf,
                                                                cli_main, caplog):
    sites.add(example_site, broken_site)
    fams = plugins.families()
    assert {"llama", "qwen2", "qwen3", "examplelm", "goodlm"} <= set(fams)  # goodlm: same plugin as badlm
    assert "badlm" not in fams
    probs = {p.plugin: p for p in plugins.problems() if p.stage in ("import", "register_model_families")}
    assert set(probs) == {"luce-broken-import", "luce-bad-declaration"}
    typo = [p for p in plugins.problems() if p.stage == "register"]
    assert len(typo) == 1 and typo[0].plugin == "luce-bad-declaration"
    assert "unknown hook(s) register_model_family" in typo[0].message
    imp = probs["luce-broken-import"]
    assert imp.stage == "import" and imp.entry_point == "broken" and "luce_nonexistent_dependency" in imp.message
    assert "plugin 'luce-broken-import' (entry point 'broken'): import" in str(imp)
    bad = probs["luce-bad-declaration"]
    assert bad.stage == "register_model_families"
    assert str(bad).startswith("plugin 'luce-bad-declaration': register_model_families: family 'badlm': "
                               "field 'optimizations.ddtree_budget': must be an int >= 1")
    assert any("luce-broken-import" in r.getMessage() for r in caplog.records)  # logged, too

    with pytest.raises(UnknownArchitectureError, match="plugins that failed: luce-bad-declaration, luce-broken-import"):
        plugins.family_for("x.gguf", "badlm")

    from click.testing import CliRunner
    r = CliRunner().invoke(cli_main, ["families"])
    assert r.exit_code == 0
    assert "plugin 'luce-broken-import' (entry point 'broken'): import: could not import" in r.output
    assert "field 'optimizations.ddtree_budget'" in r.output
    # a plugin may not replace luce's own commands
    assert cli_main.commands["info"].callback.__module__ == "luce.cli"
    assert any(p.plugin == "luce-bad-declaration" and "'info'" in p.message for p in plugins.problems())

    import luce
    m = luce.load(examplelm_gguf, backend="cpu")
    assert m.generate("Hi", max_tokens=3, temperature=0, ignore_eos=True, session=m.new_session()) is not None


@pytest.mark.parametrize("setting, loaded", [
    ("none", set()),
    ("", set()),
    ("luce-example-plugin", {PLUGIN_DIST}),
    ("example", {PLUGIN_DIST}),  # by entry-point name
    ("-broken, -luce-bad-declaration", {PLUGIN_DIST}),
    ("luce_bad_declaration,luce-broken-import", {"luce-bad-declaration", "luce-broken-import"}),
    ("all", {PLUGIN_DIST, "luce-bad-declaration", "luce-broken-import"}),
])
def test_luce_plugins_restricts_what_loads(sites, example_site, broken_site, monkeypatch, setting, loaded):
    monkeypatch.setenv("LUCE_PLUGINS", setting)
    sites.add(example_site, broken_site)
    found = {p.dist for p in plugins.plugins() if not p.builtin}
    assert found == loaded
    assert {"llama", "qwen2", "qwen3"} <= set(plugins.families())  # built-ins always load
    assert ("examplelm" in plugins.families()) == (PLUGIN_DIST in loaded)


def test_the_by_hand_install_fallback_also_works(sites, tmp_path):
    tree = tmp_path / "src"
    shutil.copytree(PLUGIN_SRC, tree, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    sites.add(_install_by_hand(tree, tmp_path / "site"))
    assert plugins.families()["examplelm"].plugin == PLUGIN_DIST


def test_qk_rope_built_from_overridden_parts():
    """A plugin overriding `rope` (or `rms_norm`) and not `qk_rope`: the forward's fused
    qk_rope must still run the plugin's kernel."""
    from luce.backends.cpu import NumpyOps
    from luce.kernels.qk_rope import qk_rope_ref
    seen = []

    def my_rope(x, positions, rope_dim, base, style):
        seen.append(x.shape)
        return NumpyOps.rope(x, positions, rope_dim, base, style)
    qk = plugins.ops_with_overrides(NumpyOps, "qwen3", "cpu").qk_rope  # no plugin: the built-in
    assert qk is NumpyOps.qk_rope
    from luce.kernels.qk_rope import qk_rope_from
    qk = qk_rope_from(NumpyOps.rms_norm, my_rope)
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((2, 4, 16)).astype(np.float32), rng.standard_normal((2, 2, 16)).astype(np.float32)
    w = np.ones(16, np.float32)
    got = qk(q, k, np.array([3, 4]), w, w, 1e-6, 16, 1e4, "halves")
    want = qk_rope_ref(q, k, np.array([3, 4]), w, w, 1e-6, 16, 1e4, "halves")
    assert seen == [(2, 4, 16), (2, 2, 16)]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


LINEAR_OVERRIDE = '''
from luce.plugins import hookimpl
CALLS = []

@hookimpl
def register_kernels(register):
    def my_linear(x, w, bias=None, residual=None):
        CALLS.append(w.shape)
        y = x @ w.T
        y = y if bias is None else y + bias
        return y if residual is None else y + residual
    register("qwen3", "linear", my_linear, backend="cpu")
'''


def test_linears_goes_through_an_overridden_linear(sites, tmp_path):
    """The forward asks for q, k and v with `linears`: a plugin that overrides only `linear`
    must still see every projection."""
    import importlib
    from luce.backends.cpu import NumpyOps
    site = tmp_path / "site"
    _fake_dist(site, "luce-linear-override", "luce_linear_override", LINEAR_OVERRIDE)
    sites.add(site)
    ops = plugins.ops_with_overrides(NumpyOps(), "qwen3", "cpu")
    ws = [np.ones((3, 4), np.float32), np.ones((2, 4), np.float32)]
    q, k = ops.linears(np.ones((1, 4), np.float32), ws, [None, np.ones(2, np.float32)])
    assert importlib.import_module("luce_linear_override").CALLS == [(3, 4), (2, 4)]
    np.testing.assert_array_equal(k, [[5.0, 5.0]])
    assert plugins.ops_with_overrides(NumpyOps(), "llama", "cpu").linears.__func__ is NumpyOps.linears
    # and linear_norm (the residual update with the norm after it) reaches it the same way
    x, norm_w = np.ones((1, 4), np.float32), np.full(3, 2.0, np.float32)
    res, h = ops.linear_norm(x, ws[0], np.ones((1, 3), np.float32), norm_w, 1e-6)
    assert importlib.import_module("luce_linear_override").CALLS[-1] == (3, 4)
    np.testing.assert_array_equal(res, [[5.0, 5.0, 5.0]])
    np.testing.assert_allclose(h, [[2.0, 2.0, 2.0]], rtol=1e-5)


def test_overridden_ops_share_the_backends_state(sites, tmp_path):
    """A backend sets per-forward state on its op object after the plugin view of it was
    made (the CUDA backend's arena): the view reads and writes the object's own, and the
    object's methods, run through the view, reach the overrides."""
    from luce.backends.cpu import NumpyOps
    site = tmp_path / "site"
    _fake_dist(site, "luce-linear-override", "luce_linear_override", LINEAR_OVERRIDE)
    sites.add(site)
    base = NumpyOps()
    ops = plugins.ops_with_overrides(base, "qwen3", "cpu")
    base.arena = "set after"
    assert ops.arena == "set after"
    ops.turn = 3
    assert base.turn == 3
    assert ops.gated_linear.__self__ is ops and ops.rms_norm is NumpyOps.rms_norm  # static ops stay plain


NORM_OVERRIDE = '''
from luce.plugins import hookimpl
from luce.kernels.norm import rms_norm_ref
CALLS = []

@hookimpl
def register_kernels(register):
    def my_rms_norm(x, w, eps):
        CALLS.append(x.shape)
        return rms_norm_ref(x, w, eps)
    register("gemma3", "rms_norm", my_rms_norm, backend="cpu")
'''


def test_post_norm_residual_goes_through_an_overridden_rms_norm(sites, tmp_path):
    """Gemma's residual step with the norm after it (`post_norm_residual`) is built from
    `add` and `rms_norm`: a plugin's rms_norm sees both of its norms."""
    import importlib
    from luce.backends.cpu import NumpyOps
    from luce.kernels.norm import post_norm_residual_ref
    site = tmp_path / "site"
    _fake_dist(site, "luce-norm-override", "luce_norm_override", NORM_OVERRIDE)
    sites.add(site)
    ops = plugins.ops_with_overrides(NumpyOps(), "gemma3", "cpu")
    rng = np.random.default_rng(0)
    y, x = (rng.standard_normal((2, 8)).astype(np.float32) for _ in range(2))
    w_post, w_next = (rng.uniform(0.5, 2, 8).astype(np.float32) for _ in range(2))
    want = post_norm_residual_ref(y, x, w_post, w_next, 1e-6)
    got = ops.post_norm_residual(y, x.copy(), w_post, w_next, 1e-6)
    assert importlib.import_module("luce_norm_override").CALLS == [(2, 8), (2, 8)]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)
