"""Each sparse optimizer moves exactly the touched rows, as its dense reference would."""

from __future__ import annotations

import pytest
import torch

from kembed_contract import trainer_config as config
from kembed_trainer import sparse_optim
from kembed_trainer.data.batch import Batch

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


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_weight_decay_adds_l2_to_the_touched_rows_only(name):
    """A table's weight_decay is torch's coupled L2 (grad + wd * w) on the rows a step touched; the rest stay."""
    from kembed_trainer import embedding

    def run(weight_decay: float, steps: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        emb = embedding.EmbeddingCollection(
            config.EmbeddingsConfig(tables=[config.TableConfig(
                name="t", num_embeddings=NUM_ROWS, embedding_dim=DIM, features=["f"], weight_decay=weight_decay)]),
            config.SparseOptimizerConfig(name=name, lr=LR), device=torch.device("cpu"), seed=0, world_size=1)
        before = emb.groups[0].weight.clone()
        ids = torch.tensor([1, 4])
        batch = Batch(torch.zeros(2, 0), ids, torch.ones(2, dtype=torch.int64), torch.zeros(2))
        for step in range(steps):
            (emb(batch)[0] * torch.tensor([[[1.0, -2.0, 0.5, 3.0]]])).sum().backward()
            emb.step(step)
        return before, emb.groups[0].weight

    before, plain = run(0.0)
    _, decayed = run(0.5)
    untouched = [r for r in range(NUM_ROWS) if r not in (1, 4)]
    assert torch.equal(decayed[untouched], before[untouched])
    # The touched rows move differently (shrunk towards 0); for sgd exactly w - lr * (grad + wd * w).
    assert not torch.allclose(decayed[[1, 4]], plain[[1, 4]])
    if name == "sgd":
        _, one_step = run(0.5, steps=1)
        grad = torch.tensor([1.0, -2.0, 0.5, 3.0]).expand(2, DIM)
        assert torch.allclose(one_step[[1, 4]], before[[1, 4]] - LR * (grad + 0.5 * before[[1, 4]]))
