"""PTX checks in the background: a check (a compile of sm_90 code through libNVVM in a
fresh interpreter, luce.kernels.ptx.run_check) takes 20-30 s of one core. Started when its
module's first test runs, it compiles on the second core while the module's simulator
tests keep the first one busy; its test collects the result."""
import tempfile

import pytest


def background_ptx_check(body: str):
    """A module-scoped autouse fixture running `body` in the background; the fixture's value
    is a function returning (returncode, stdout, stderr) once it is done."""
    @pytest.fixture(scope="module", autouse=True)
    def ptx_check():
        from luce.kernels.ptx import run_check
        # temp files, not pipes: nobody reads a pipe until its test, and a full one stalls the compile
        out_f, err_f = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        proc = run_check(body, background=(out_f, err_f))

        def result():
            proc.wait(timeout=600)
            out_f.seek(0)
            err_f.seek(0)
            return proc.returncode, out_f.read(), err_f.read()
        yield result
        if proc.poll() is None:  # its test was deselected
            proc.kill()
            proc.communicate()
    return ptx_check


def assert_ptx_ok(result):
    rc, out, err = result()
    # libNVVM comes with the dev extra (nvidia-cuda-nvcc-cu12): missing, this fails
    assert rc == 0 and "PTX OK" in out, out[-2000:] + err[-4000:]
