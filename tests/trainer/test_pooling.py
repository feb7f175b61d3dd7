"""The lookup's pooling and its hand-written backward give what autograd through `F.embedding_bag` over the
whole tables gives, whatever mix of replicated and sharded tables (sharded first: they are stacked last)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kembed_contract import trainer_config as config
from kembed_trainer import embedding, pooling
from kembed_trainer.data.batch import Batch


@pytest.mark.parametrize(
    "num_rows", [pytest.param(50, id="int32-keys"), pytest.param(2**31 + 1, id="int64-keys")]
)
def test_pool_equals_embedding_bag_forward_and_backward(num_rows):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 3, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([2, 0, 3, 1, 4, 0, 2])  # empty bags, and ids repeated within and across bags
    rows = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
    rows[1] = rows[0]
    grad_out = torch.randn(lengths.numel(), 3, generator=gen, dtype=torch.float64)

    full = weight.clone().requires_grad_(True)
    want = F.embedding_bag(rows, full, torch.cumsum(lengths, 0) - lengths, mode="sum")
    want.backward(grad_out)

    bags = pooling.plan_bags(rows, lengths, num_rows)
    assert torch.equal(bags.unique_rows, torch.unique(rows))
    touched = weight[bags.unique_rows].requires_grad_(True)
    got = pooling.pool(touched, bags)
    got.backward(grad_out)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(touched.grad, full.grad[bags.unique_rows])
    assert torch.autograd.gradcheck(lambda v: pooling.pool(v, bags), (touched.detach().requires_grad_(),))


def mixed_tables() -> config.EmbeddingsConfig:
    return config.EmbeddingsConfig.model_validate(
        {
            "tables": [
                {"name": "big", "num_embeddings": 40, "embedding_dim": 4, "features": ["a"], "lr_scale": 0.5},
                {"name": "small", "num_embeddings": 7, "embedding_dim": 4, "features": ["b", "c"]},
                {"name": "big2", "num_embeddings": 30, "embedding_dim": 4, "features": ["d"]},
            ],
            "shard_threshold_rows": 30,
        }
    )


def test_mixed_sharded_and_replicated_lookup_and_update_match_plain_autograd():
    emb_cfg = mixed_tables()
    emb = embedding.EmbeddingCollection(
        emb_cfg,
        config.SparseOptimizerConfig(name="sgd", lr=0.1),
        device=torch.device("cpu"),
        seed=1,
        world_size=1,
    )
    assert [g.sharded.tolist() for g in emb.groups] == [[True, False, True]]
    tables = {
        t.name: emb.state_dict()[f"{t.name}.weight"].clone().requires_grad_(True) for t in emb_cfg.tables
    }
    table_of = {"a": "big", "b": "small", "c": "small", "d": "big2"}
    sizes = {"a": 40, "b": 7, "c": 7, "d": 30}

    gen = torch.Generator().manual_seed(2)
    batch_size = 6
    lengths = torch.randint(0, 3, (4, batch_size), generator=gen)
    values = [
        torch.randint(0, sizes[f], (int(n),), generator=gen)
        for f, n in zip("abcd", lengths.sum(1), strict=True)
    ]
    batch = Batch(torch.zeros(batch_size, 0), torch.cat(values), lengths.reshape(-1), torch.zeros(batch_size))

    (pooled,) = emb(batch)
    want = torch.stack(
        [
            F.embedding_bag(v, tables[table_of[f]], torch.cumsum(n, 0) - n, mode="sum")
            for f, v, n in zip("abcd", values, lengths, strict=True)
        ],
        1,
    )
    torch.testing.assert_close(pooled, want)

    weights = torch.randn(pooled.shape, generator=gen)
    (pooled * weights).sum().backward()
    (want * weights).sum().backward()
    emb.step(0)
    after = emb.state_dict()
    for t in emb_cfg.tables:
        lr = 0.1 * t.lr_scale
        torch.testing.assert_close(
            after[f"{t.name}.weight"], tables[t.name].detach() - lr * tables[t.name].grad
        )
