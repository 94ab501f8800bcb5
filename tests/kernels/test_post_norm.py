"""luce.kernels.post_norm (Gemma's post-norm residual step and the next norm in one launch)
in the CUDA simulator, against post_norm_residual_ref (numpy): the residual stream updated
in place, the next norm's output, and its int8 form bit for bit that of quantize_x_ref
applied to the output the kernel wrote. Buffers start as NaN / 0xFFFF so that an unwritten
element fails."""
import numpy as np
import pytest
from numba import cuda

from luce.kernels.post_norm import post_norm_residual_cuda, post_norm_residual_ref
from luce.kernels.quantize_x import quantize_x_ref, xq_size
from test_quantize_x import assert_same_form


@pytest.mark.parametrize("rows,d,planes", [(1, 96, None), (2, 64, 1), (1, 96, 2), (2, 40, None)])
def test_post_norm_residual(rows, d, planes):
    rng = np.random.default_rng(d + rows)
    y = (rng.standard_normal((rows, d)) * 30).astype(np.float32)  # a sublayer output, not normed
    x = rng.standard_normal((rows, d)).astype(np.float32)
    w_post, w_next = (rng.uniform(0.2, 2.0, d).astype(np.float32) for _ in range(2))
    x_dev = cuda.to_device(x)
    h = cuda.to_device(np.full((rows, d), np.nan, np.float32))
    xq = None if planes is None else cuda.to_device(np.full(xq_size(d, rows, planes), 0xFFFF, np.uint16))
    got_x, got_h = post_norm_residual_cuda(cuda.to_device(y), x_dev, cuda.to_device(w_post), cuda.to_device(w_next),
                                           1e-6, h=h, xq=xq, planes=planes or 1)
    assert got_x is x_dev and got_h is h  # the residual stream in place
    want_x, want_h = post_norm_residual_ref(y, x, w_post, w_next, 1e-6)
    np.testing.assert_allclose(x_dev.copy_to_host(), want_x, rtol=1e-5, atol=1e-5)
    hh = h.copy_to_host()
    np.testing.assert_allclose(hh, want_h, rtol=1e-5, atol=1e-5)
    if planes is not None:
        assert_same_form(xq.copy_to_host(), quantize_x_ref(hh, planes), planes, rtol=1e-5, atol=1e-5)


def test_post_norm_residual_rejects_bad_shapes():
    x = cuda.to_device(np.zeros((1, 64), np.float32))
    w = cuda.to_device(np.ones(64, np.float32))
    with pytest.raises(ValueError, match="differ"):
        post_norm_residual_cuda(cuda.to_device(np.zeros((1, 32), np.float32)), x, w, w, 1e-6)
    with pytest.raises(ValueError, match="uint16"):
        post_norm_residual_cuda(x, x, w, w, 1e-6, xq=cuda.to_device(np.zeros(5, np.uint16)))
