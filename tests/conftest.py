import os

# Kernel tests run in numba's CUDA simulator unless a GPU run asks otherwise
# (NUMBA_ENABLE_CUDASIM=0 pytest -m gpu); it must be set before numba is imported.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path():
    from luce.models.bundled import smollm2_path
    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """SmolLM2-135M-Instruct on the CPU backend, loaded once for the whole run."""
    import luce
    return luce.load(smollm2_path, backend="cpu")
