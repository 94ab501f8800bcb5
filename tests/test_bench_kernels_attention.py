"""Which rows `python -m luce.bench.kernels_attention NAMES` runs (luce.bench.kernels_attention
.selected): prefixes, and exact names ending in "$"."""
from luce.bench.kernels_attention import against_decode, selected


def test_prefixes_and_exact_names():
    names = ["decode", "decode_nosplit", "decode640_in_grid", "tree23", "tree23_640_in_grid", "tree23_q8_0"]
    assert [n for n in names if selected(n, "tree23")] == ["tree23", "tree23_640_in_grid", "tree23_q8_0"]
    assert [n for n in names if selected(n, "tree23$,decode$")] == ["decode", "tree23"]
    assert [n for n in names if selected(n, "decode$, tree23_640")] == ["decode", "tree23_640_in_grid"]
    assert not any(selected(n, "prefill") for n in names)


def test_rows_against_decode_at_their_context():
    rows = [dict(name="attention_decode", time_us=20.0), dict(name="attention_decode_combine_only", time_us=5.0),
            dict(name="attention_decode640_in_grid", time_us=10.0), dict(name="attention_tree23", time_us=45.0),
            dict(name="attention_tree23_640_in_grid", time_us=21.0)]
    assert [r["x decode"] for r in against_decode(rows)] == [1.0, None, 1.0, 2.25, 2.1]
    # no decode row at that context: nothing to compare with
    assert against_decode([dict(name="attention_tree23", time_us=45.0)])[0]["x decode"] is None
