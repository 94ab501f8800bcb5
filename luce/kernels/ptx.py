"""Compile luce's kernels to PTX for a GPU that is not there.

The CUDA simulator never compiles GPU code (inline asm, shuffles, bit casts), so tests
compile the real kernels to PTX with libNVVM (the `nvidia-cuda-nvcc-cu12` wheel ships it)
on machines without a GPU or driver. Numba asks the current device for its compute
capability; `offline_target` answers for it. Run in a separate process with
NUMBA_ENABLE_CUDASIM=0: the patches are process-wide.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys


def offline_target(cc: tuple[int, int] = (9, 0)) -> None:
    """Make numba compile for `cc` without a device. Raises RuntimeError without libNVVM."""
    import numba.cuda.codegen as codegen
    import numba.cuda.cudadrv.nvvm as nvvm
    import numba.cuda.dispatcher as dispatcher
    try:
        nvvm.NVVM()
    except Exception as e:  # the message names what is missing
        raise RuntimeError(f"no libNVVM: {e}") from None

    class Target:
        compute_capability = cc

    dispatcher.get_current_device = lambda: Target()  # device functions ask the (absent) GPU
    codegen.nvrtc.get_arch_option = lambda major, minor: f"compute_{major}{minor}"


def compile_ptx(kernel, sig, cc: tuple[int, int] = (9, 0)) -> str:
    from numba import cuda
    fn = getattr(kernel, "py_func", kernel)
    return cuda.compile_ptx(fn, sig, cc=cc)[0]


def has_local_memory(ptx: str) -> bool:
    """Spills or indexed local arrays: what a register-resident kernel must not have."""
    return re.search(r"\.local\b", ptx) is not None


def ptxas_path() -> str | None:
    found = shutil.which("ptxas")
    if found:
        return found
    try:
        import nvidia.cuda_nvcc as nv
    except ImportError:
        return None
    return next(iter(glob.glob(os.path.join(list(nv.__path__)[0], "bin", "ptxas"))), None)


def ptxas_usage(ptx: str, arch: str = "sm_90") -> dict:
    """Assemble `ptx` with ptxas -v: {registers, spill_bytes} of its (one) kernel."""
    import tempfile
    exe = ptxas_path()
    if exe is None:
        raise RuntimeError("no ptxas (the dev extra's nvidia-cuda-nvcc-cu12 ships one)")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        r = subprocess.run([exe, f"-arch={arch}", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    spill = re.findall(r"(\d+) bytes (?:stack frame|spill stores|spill loads)", r.stderr)
    return {"registers": int(re.search(r"Used (\d+) registers", r.stderr).group(1)),
            "spill_bytes": sum(int(v) for v in spill)}


def run_check(body: str, timeout: int = 600, background: bool = False):
    """Run `body` (Python source) in a fresh interpreter after `offline_target()`.
    Returns the CompletedProcess, or the Popen when `background` (stdout/stderr piped)."""
    script = "from luce.kernels.ptx import offline_target\noffline_target()\n" + body
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    args = [sys.executable, "-c", script]
    if background:  # a (stdout, stderr) pair of files, or True for pipes
        out, err = background if isinstance(background, tuple) else (subprocess.PIPE, subprocess.PIPE)
        return subprocess.Popen(args, stdout=out, stderr=err, text=True, env=env)
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
