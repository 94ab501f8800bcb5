"""Programmatic dependent launch (PDL) for the kernels of captured forward graphs.

Why: a decode step is ~290 dependent launches in one CUDA graph, and on the H200 the time
between them is ~15% of the step (Qwen3-8B shape: graph 3,229 us against 2,720 us of
kernels, `luce bench`'s breakdown): each kernel starts only after the one before has
drained its last blocks and flushed its writes. With a programmatic edge (sm_90+) the
next kernel is launched while the one before still runs, its blocks wait at
`griddepcontrol.wait` until that one has finished and its writes are visible, so the
launch and the block scheduling overlap the tail of the kernel before.

How: a kernel that may be launched early begins with `grid_dependency_sync()` (the wait,
then `griddepcontrol.launch_dependents`, so that the kernel after it may launch in turn:
at most one kernel waits behind a running one) and is marked with `ready()`. Numba
launches kernels without launch attributes, so luce.backends.cuda_graph records the
launches while it captures a graph and turns the edges into programmatic ones after
capture (`programmatic_edges`), only into kernels marked here, whose first instruction is
the wait: an unmarked kernel keeps a full dependency. Every kernel of luce.kernels that a
forward launches is marked (decode, tree verification, prefill): a kernel's first
statement is the wait, so nothing it reads or writes can race the one before.

On by default on a device of compute capability 9.0+ (H200, Qwen3-8B shape: graph 3,145
-> 3,022 us a step, decode 304.3 -> 314.8 tok/s in one call); LUCE_PDL=0, the simulator
and older devices (the instructions do not exist before sm_90) turn it off: then
`grid_dependency_sync()` emits nothing and kernels are as without this module.
"""
from __future__ import annotations

import os

from numba import cuda

from .vector_load import SIM

__all__ = ["ENABLED", "PREFETCH", "grid_dependency_sync", "l2_prefetch", "ready", "is_ready",
           "programmatic_edges"]


def _enabled() -> bool:
    if os.environ.get("LUCE_PDL", "1") in ("", "0") or SIM:
        return False
    try:
        return cuda.is_available() and cuda.get_current_device().compute_capability >= (9, 0)
    except Exception:  # no driver: nothing to launch early
        return False


# read when a kernel is compiled: set it before the first launch (tests set it for the PTX)
ENABLED = _enabled()
# LUCE_PDL=2: also start each matvec block's first rows of weights toward L2 before the
# wait (weights depend on no kernel), so a product launched early streams during the
# tail of the one before it; measured slower (8B decode 285.6 against 314.8 for =1)
PREFETCH = ENABLED and os.environ.get("LUCE_PDL") == "2"

if SIM:
    def grid_dependency_sync():
        pass

    def l2_prefetch(arr, i, nbytes):
        pass
else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from .bulk_copy import emit_l2_prefetch
    from .mma import _asm

    @intrinsic
    def grid_dependency_sync(typingctx):
        """Wait until the grids this launch depends on have finished and their writes are
        visible (a no-op without a programmatic dependency), then let the next launch
        begin. Nothing where PDL is off."""
        sig = types.void()

        def codegen(context, builder, sig, args):
            if ENABLED:
                _asm(builder, "griddepcontrol.wait; griddepcontrol.launch_dependents;", "~{memory}", ir.VoidType(),
                     [], [], side_effect=True)
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def l2_prefetch(typingctx, arr, i, nbytes):
        """bulk_copy.l2_prefetch where PREFETCH, else nothing."""
        sig = types.void(arr, i, nbytes)

        def codegen(context, builder, sig, args):
            if PREFETCH:
                emit_l2_prefetch(context, builder, sig, args)
            return context.get_dummy_value()
        return sig, codegen


_MARK = "__luce_pdl_ready__"


def _py_func(kernel):
    return getattr(kernel, "py_func", None) or getattr(kernel, "fn", None)  # a dispatcher, or the simulator's


def ready(kernel):
    """Mark a kernel (a numba dispatcher) whose body begins with grid_dependency_sync():
    a captured graph may launch it before the kernel it depends on has finished. Every
    forward kernel passes here, so here it also gets its disk cache (luce.kernels.disk_cache)."""
    from . import disk_cache
    setattr(_py_func(kernel), _MARK, True)
    return disk_cache.enable(kernel)


def is_ready(py_func) -> bool:
    return bool(getattr(py_func, _MARK, False))


def programmatic_edges(order, kinds, dims, launches):
    """The edges (i, i + 1) of a captured chain of nodes to make programmatic.

    order: the graph's nodes in their one chain (None: not a chain); kinds[n]: "kernel" or
    anything else for node n; dims[n]: a kernel node's (grid, block) as 3-tuples; launches:
    (ready, grid, block) of each kernel launch made while capturing, in order. The kernel
    nodes must be those launches one for one (same count, same shapes), else nothing is
    changed (a launch this module did not see, such as a library's, would make the
    matching wrong). Returns [(node a, node b)] for consecutive kernel nodes whose second
    is ready."""
    if order is None:
        return []
    kernels = [n for n in order if kinds[n] == "kernel"]
    if len(kernels) != len(launches) or any(dims[n] != (g, b) for n, (_, g, b) in zip(kernels, launches)):
        return []
    ok = {n: r for n, (r, _, _) in zip(kernels, launches)}
    return [(a, b) for a, b in zip(order, order[1:]) if kinds[a] == "kernel" and kinds[b] == "kernel" and ok[b]]


def dim3(d) -> tuple:
    """A launch's grid or block as (x, y, z)."""
    d = tuple(d) if isinstance(d, (tuple, list)) else (d,)
    return tuple(int(v) for v in d) + (1,) * (3 - len(d))
