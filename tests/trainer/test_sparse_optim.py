"""Each sparse optimizer moves exactly the touched rows, as its dense reference would."""

from __future__ import annotations

import pytest
import torch

from kembed_trainer import config, sparse_optim

NUM_ROWS, DIM, LR = 10, 4, 0.1
ROWS = [torch.tensor([1, 4, 7]), torch.tensor([0, 4, 9])]  # two steps, row 4 touched twice


def sparse_run(name: str) -> torch.Tensor:
    opt = sparse_optim.build_sparse_optimizer(config.SparseOptimizerConfig(name=name, lr=LR, eps=1e-8))
    weight = torch.linspace(-1, 1, NUM_ROWS * DIM).view(NUM_ROWS, DIM).clone()
    state = opt.init_state(NUM_ROWS, DIM, torch.device("cpu"))
    for step, rows in enumerate(ROWS):
        grad = torch.sin(weight[rows] * 3 + step)
        opt.update(weight, state, rows, grad, torch.full((len(rows),), LR), step)
    return weight


def dense_reference(make_optimizer) -> torch.Tensor:
    """A torch optimizer over the whole matrix, with zero gradient on the rows a step did not touch."""
    weight = torch.nn.Parameter(torch.linspace(-1, 1, NUM_ROWS * DIM).view(NUM_ROWS, DIM).clone())
    opt = make_optimizer([weight])
    for step, rows in enumerate(ROWS):
        grad = torch.zeros(NUM_ROWS, DIM)
        grad[rows] = torch.sin(weight.detach()[rows] * 3 + step)
        weight.grad = grad
        opt.step()
    return weight.detach()


def rowwise_adagrad_reference() -> torch.Tensor:
    weight = torch.linspace(-1, 1, NUM_ROWS * DIM).view(NUM_ROWS, DIM).clone()
    sum_sq = torch.zeros(NUM_ROWS)
    for step, rows in enumerate(ROWS):
        for r in rows.tolist():
            g = torch.sin(weight[r] * 3 + step)
            sum_sq[r] += (g * g).mean()
            weight[r] -= LR * g / (sum_sq[r].sqrt() + 1e-8)
    return weight


def sparse_adam_reference() -> torch.Tensor:
    emb = torch.nn.Embedding(NUM_ROWS, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.linspace(-1, 1, NUM_ROWS * DIM).view(NUM_ROWS, DIM))
    opt = torch.optim.SparseAdam(emb.parameters(), lr=LR, eps=1e-8)
    for step, rows in enumerate(ROWS):
        out = emb(rows)
        out.backward(torch.sin(out.detach() * 3 + step))
        opt.step()
        opt.zero_grad()
    return emb.weight.detach()


@pytest.mark.parametrize(
    ("name", "reference"),
    [
        pytest.param("sgd", lambda: dense_reference(lambda p: torch.optim.SGD(p, lr=LR)), id="sgd"),
        pytest.param(
            "adagrad",
            lambda: dense_reference(lambda p: torch.optim.Adagrad(p, lr=LR, eps=1e-8)),
            id="adagrad",
        ),
        pytest.param("rowwise_adagrad", rowwise_adagrad_reference, id="rowwise_adagrad"),
        pytest.param("adam", sparse_adam_reference, id="lazy-adam"),
    ],
)
def test_sparse_update_equals_reference_on_touched_rows(name, reference):
    start = torch.linspace(-1, 1, NUM_ROWS * DIM).view(NUM_ROWS, DIM)
    got, want = sparse_run(name), reference()
    touched = torch.unique(torch.cat(ROWS))
    untouched = torch.tensor([r for r in range(NUM_ROWS) if r not in touched.tolist()])
    torch.testing.assert_close(got[touched], want[touched], rtol=1e-5, atol=1e-6)
    assert not torch.equal(got[touched], start[touched])
    torch.testing.assert_close(got[untouched], start[untouched], rtol=0, atol=0)  # lazy: never moved
