"""Which rows `python -m luce.bench.kernels_attention NAMES` runs (luce.bench.kernels_attention
.selected): prefixes, and exact names ending in "$"."""
from luce.bench.kernels_attention import selected


def test_prefixes_and_exact_names():
    names = ["decode", "decode_nosplit", "decode640_in_grid", "tree23", "tree23_640_in_grid", "tree23_q8_0"]
    assert [n for n in names if selected(n, "tree23")] == ["tree23", "tree23_640_in_grid", "tree23_q8_0"]
    assert [n for n in names if selected(n, "tree23$,decode$")] == ["decode", "tree23"]
    assert [n for n in names if selected(n, "decode$, tree23_640")] == ["decode", "tree23_640_in_grid"]
    assert not any(selected(n, "prefill") for n in names)
