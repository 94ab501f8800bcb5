"""luce-example-plugin: the `examplelm` model family, as a third-party luce plugin.

`examplelm` is a llama-like decoder built from luce's existing blocks: q/k/v projection
biases (as in qwen2), RMSNorm on each q and k head (as in qwen3), and NEOX rotation of
the two halves of a head. luce's shared transformer forward runs it, switched by the
flags the config reader sets.
"""
from __future__ import annotations

import numpy as np

from luce.gguf_file import GGUFFile
from luce.models.config import ROPE_HALVES, ModelConfig, read_config
from luce.models.family import ChatFormat, DraftSpec, ModelFamily, Optimizations
from luce.plugins import hookimpl

ARCH = "examplelm"


def examplelm_config(f: GGUFFile) -> ModelConfig:
    """Read the `examplelm.*` keys (block_count, embedding_length, ...)."""
    return read_config(f, rope_style=ROPE_HALVES, qkv_bias=True, qk_norm=True)


FAMILY = ModelFamily(
    name="examplelm",
    architectures=(ARCH,),
    description="ExampleLM: llama-like, q/k/v bias + q/k norm (luce-example-plugin)",
    read_config=examplelm_config,
    forward=None,  # luce.models.transformer.forward: the shared decoder forward
    chat_format=ChatFormat(tool_call_format="hermes", reasoning=True),
    sampling_defaults={"temperature": 0.7, "top_k": 30},
    drafts=(DraftSpec(kind="lookup", name="prompt-lookup", description="prompt n-gram lookup",
                      options={"max_ngram": 3}),),
    optimizations=Optimizations(ddtree_budget=8, kv_paging=True, kv_types=("f16",), sliding_window=False),
)


@hookimpl
def register_model_families(register):
    register(FAMILY)


# A kernel override for this family on the CPU backend: the same math as luce's numpy
# reference (silu(gate) * up), computed in float64 and counted, so tests can see it used.
calls = {"swiglu": 0}


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    calls["swiglu"] += 1
    g = gate.astype(np.float64)
    return (g / (1.0 + np.exp(-g)) * up).astype(np.float32)


@hookimpl
def register_kernels(register):
    register("examplelm", "swiglu", swiglu, backend="cpu")


@hookimpl
def register_commands(cli):
    import click

    @cli.command("example-hello")
    @click.option("--name", default="world")
    def example_hello(name):
        """Say hello from luce-example-plugin."""
        click.echo(f"hello {name} from luce-example-plugin")
