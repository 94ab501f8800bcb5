"""rms_norm_cuda's fused forms in the CUDA simulator: Gemma's post-norm residual step and the
next norm in one launch (pre_weight, residual), and the output's int8 form (xq), against
post_norm_residual_ref (numpy) and quantize_x_ref applied to the output the kernel wrote
(bit for bit). Buffers start as NaN / 0xFFFF so that an unwritten element fails."""
import numpy as np
import pytest
from numba import cuda

from luce.kernels.norm import post_norm_residual_ref, rms_norm_cuda, rms_norm_ref
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
    got = rms_norm_cuda(cuda.to_device(y), cuda.to_device(w_next), 1e-6, out=h, residual=x_dev, residual_out=x_dev,
                        pre_weight=cuda.to_device(w_post), xq=xq, planes=planes or 1)
    assert got is h
    want_x, want_h = post_norm_residual_ref(y, x, w_post, w_next, 1e-6)
    np.testing.assert_allclose(x_dev.copy_to_host(), want_x, rtol=1e-5, atol=1e-5)  # the residual stream, in place
    hh = h.copy_to_host()
    np.testing.assert_allclose(hh, want_h, rtol=1e-5, atol=1e-5)
    if planes is not None:
        assert_same_form(xq.copy_to_host(), quantize_x_ref(hh, planes), planes, rtol=1e-5, atol=1e-5)


def test_int8_form_of_a_plain_norm_and_bad_sizes():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 64)) * 4).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    xq = cuda.to_device(np.full(xq_size(64, 2, 1), 0xFFFF, np.uint16))
    out = rms_norm_cuda(cuda.to_device(x), cuda.to_device(w), 1e-6, xq=xq).copy_to_host()
    np.testing.assert_allclose(out, rms_norm_ref(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    assert_same_form(xq.copy_to_host(), quantize_x_ref(out, 1), 1, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="int8 form"):
        rms_norm_cuda(cuda.to_device(x), cuda.to_device(w), 1e-6, xq=cuda.to_device(np.zeros(5, np.uint16)))
