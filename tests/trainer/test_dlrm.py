"""DLRM's dot interaction: the hand-written backward is the gradient of the plain `bmm(z, z^T)` pairs."""

from __future__ import annotations

import torch

from kembed_contract import trainer_config as config
from kembed_trainer.models import dlrm


def model() -> dlrm.DLRM:
    return dlrm.DLRM(
        config.DLRMConfig(kind="dlrm", bottom_mlp=[8, 4], top_mlp=[8]),
        num_dense=3,
        num_sparse=5,
        embedding_dim=4,
    )


def plain_dots(z: torch.Tensor) -> torch.Tensor:
    rows, cols = torch.tril_indices(z.shape[1], z.shape[1], offset=-1)
    return torch.bmm(z, z.transpose(1, 2))[:, rows, cols]


def test_pairwise_dots_and_their_gradient_match_autograd_through_bmm():
    m = model()
    z = torch.randn(5, 6, 4, dtype=torch.float64, requires_grad=True)
    dots = dlrm._PairwiseDots.apply(z, m.pairs, m.pair_of_place)
    assert torch.equal(dots, plain_dots(z))
    grad = torch.randn(dots.shape, dtype=torch.float64)
    (got,) = torch.autograd.grad(dots, z, grad)
    (want,) = torch.autograd.grad(plain_dots(z), z, grad)
    torch.testing.assert_close(got, want)
    assert torch.autograd.gradcheck(lambda v: dlrm._PairwiseDots.apply(v, m.pairs, m.pair_of_place), (z,))


def test_dlrm_under_bf16_autocast_backpropagates_float32_gradients():
    m = model()
    pooled = torch.randn(2, 5, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(torch.randn(2, 3), [pooled])
    out.float().sum().backward()
    assert pooled.grad.dtype == torch.float32 and pooled.grad.abs().sum() > 0
