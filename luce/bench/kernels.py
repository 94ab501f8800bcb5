"""`luce bench --kernels`: each kernel family at Qwen3-8B and Qwen3-32B layer shapes,
against ceilings measured in the same run (device copy bandwidth)."""
from __future__ import annotations

# (rows, cols) of the decode matrices: Qwen3-8B q/o/gate-up/down, Qwen3-32B gate-up/down
MATVEC_SHAPES = ((4096, 4096), (12288, 4096), (4096, 12288), (25600, 5120), (5120, 25600))


def run(record: bool = True) -> dict:
    from .ceilings import copy_bandwidth_gbs
    from .kernels_attention import bench_attention
    from .kernels_matvec_mma import bench_matvec_mma
    from .kernels_read import DIRECT, EMPTY, bench_read
    from .kernels_small import bench_small_ops
    from .kernels_matmul import SMALL_M_SHAPES, bench_gated, bench_matmul
    from ..kernels.matvec_fast import bench_matvec_fast
    from .report import append_to_docs, print_table
    from ..kernels.matvec import bench_matvec

    bw = copy_bandwidth_gbs()
    sections = []

    def add(title, rows, ceiling_key=None):
        if ceiling_key:
            for r in rows:
                r["% of copy BW"] = None if r[ceiling_key] is None else 100 * r[ceiling_key] / bw
        cols = list(rows[0]) if rows else []
        print_table(title, rows, cols)
        sections.append((title, rows, cols))

    add("read ceiling at the decode step's weight sizes (no arithmetic)",
        bench_read(variants=tuple(v for v in DIRECT if v[2] <= 2 and v[3] >= 4) + (EMPTY,)), "GB/s")
    add("fast matvec, 1 row (decode; weights rotated past L2)", bench_matvec_fast(MATVEC_SHAPES), "GB/s")
    add("generic matvec, 1 row", bench_matvec(MATVEC_SHAPES[:3], ("Q4_K", "Q6_K", "Q8_0")), "GB/s")
    add("verification widths: small-M tensor-core matmul vs 1-row matvec", bench_matmul(SMALL_M_SHAPES, baseline=True),
        "GB/s")
    add("prefill matmul, 512 rows", bench_matmul())
    add("prefill SwiGLU FFN (Qwen3-8B, 32B): one launch vs two and the SwiGLU kernel", bench_gated())
    add("tensor-core small-M product (matvec_mma) vs what runs now", bench_matvec_mma(), "GB/s")
    add("attention over 8K context (Qwen3-8B heads)", bench_attention())
    add("small per-layer ops (Qwen3-8B shape)", bench_small_ops())
    print(f"device copy bandwidth (read + write): {bw:.0f} GB/s")
    if record:
        append_to_docs("luce bench --kernels", sections, notes=f"ceiling: device copy bandwidth {bw:.0f} GB/s "
                       "(read + write bytes) measured in this run")
    return {"copy_gbs": bw, "sections": sections}
