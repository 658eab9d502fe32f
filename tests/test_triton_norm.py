"""The RMSNorm kernel (interpreted on the CPU) against model.add_rms_norm's plain ops: with and without the residual
add, fp32 and bf16, a sliced last position as the model hands it over; and each row the same computed alone as
among others (what keeps a verification's tokens bitwise equal to decode's on the GPU)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # set before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from magicdec.model.transformer import add_rms_norm  # noqa: E402
from magicdec.model.triton_norm import add_rms_norm as kernel  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_matches_plain_ops(dtype, with_delta):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 96, generator=g).to(dtype)
    delta = torch.randn(3, 5, 96, generator=g).to(dtype) if with_delta else None
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    total, normed = kernel(x, delta, w, 1e-5)
    ref_total, ref_normed = add_rms_norm.__wrapped__(x, delta, w, 1e-5)
    assert total.dtype == normed.dtype == dtype and normed.shape == x.shape
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    # bf16: within a rounding step (Triton's CPU interpreter rounds to bf16 its own way; the GPU rounds to nearest)
    torch.testing.assert_close(total, ref_total, **(dict(atol=0, rtol=0) if dtype == torch.float32 else tol))
    torch.testing.assert_close(normed, ref_normed, **tol)


def test_reads_a_sliced_last_position_and_each_row_alone_equals_it_among_others():
    g = torch.Generator().manual_seed(1)
    x, delta = torch.randn(2, 4, 64, generator=g), torch.randn(2, 4, 64, generator=g)
    w = torch.randn(64, generator=g)
    last_total, last_normed = kernel(x[:, -1:], delta[:, -1:], w, 1e-6)  # strided rows, as logits="last" passes
    all_total, all_normed = kernel(x, delta, w, 1e-6)
    assert torch.equal(last_total, all_total[:, -1:]) and torch.equal(last_normed, all_normed[:, -1:])
    ref = add_rms_norm.__wrapped__(x[:, -1:], delta[:, -1:], w, 1e-6)[1]
    torch.testing.assert_close(last_normed, ref, atol=1e-5, rtol=1e-5)
