"""Row-wise sharded tables: the same model as one rank training on the whole batch, at a fraction of the memory."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kembed_contract import trainer_config as config
from kembed_trainer import embedding
from kembed_trainer.data.batch import Batch
from tests.trainer.conftest import run_trainer, tiny_config, write_config

NUM_FEATURES, BATCH, STEPS, WORLD = 3, 16, 4, 2


def embeddings_config() -> config.EmbeddingsConfig:
    return config.EmbeddingsConfig.model_validate(
        {
            "tables": [
                # 101 rows: shards of 51 and 50, so the uneven last shard is exercised.
                {
                    "name": "big",
                    "num_embeddings": 101,
                    "embedding_dim": 4,
                    "features": ["a", "b"],
                    "lr_scale": 0.5,
                },
                {"name": "small", "num_embeddings": 7, "embedding_dim": 4, "features": ["c"]},
                {
                    "name": "forced",
                    "num_embeddings": 5,
                    "embedding_dim": 4,
                    "features": ["d"],
                    "sharding": "row_wise",
                },
            ],
            "shard_threshold_rows": 100,
        }
    )


def global_batch(step: int) -> Batch:
    """WORLD * BATCH samples, multi-hot, feature-major (a, b, c, d); ids repeat across samples and ranks."""
    gen = torch.Generator().manual_seed(step)
    n = WORLD * BATCH
    lengths = torch.randint(0, 4, (4, n), generator=gen)
    values = [
        torch.randint(0, size, (int(lengths[f].sum()),), generator=gen)
        for f, size in enumerate([101, 101, 7, 5])
    ]
    return Batch(torch.zeros(n, 0), torch.cat(values), lengths.reshape(-1), torch.zeros(n))


def rank_slice(batch: Batch, rank: int) -> Batch:
    """Samples [rank * BATCH, (rank + 1) * BATCH) of a global batch."""
    lengths = batch.lengths.view(4, -1)
    per_feature = torch.split(batch.values, lengths.sum(1).tolist())
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    values = [v[lengths[f, :lo].sum() : lengths[f, :hi].sum()] for f, v in enumerate(per_feature)]
    return Batch(batch.dense[lo:hi], torch.cat(values), lengths[:, lo:hi].reshape(-1), batch.labels[lo:hi])


def train(optimizer: str, rank: int, world_size: int) -> embedding.EmbeddingCollection:
    emb = embedding.EmbeddingCollection(
        embeddings_config(),
        config.SparseOptimizerConfig(name=optimizer, lr=0.1),
        device=torch.device("cpu"),
        seed=3,
        world_size=world_size,
        rank=rank,
    )
    for step in range(STEPS):
        batch = global_batch(step) if world_size == 1 else rank_slice(global_batch(step), rank)
        (pooled,) = emb(batch)
        # A per-rank mean, averaged over ranks, is the mean over the global batch (as with DDP).
        loss = (pooled.sin() * torch.arange(1, 5)).sum() / batch.batch_size
        loss.backward()
        emb.step(step)
    return emb


def full_tables(emb: embedding.EmbeddingCollection) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in emb.state_dict().items()
    }


def _rank_main(rank: int, optimizer: str, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    emb = train(optimizer, rank, WORLD)
    tables = full_tables(emb)
    local_rows = {g.tables[0].name: g.shard.shape[0] for g in emb.groups}
    if rank == 0:
        torch.save({"tables": tables, "local_rows": local_rows, "num_bytes": emb.num_bytes}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam", "sgd"])
def test_two_sharded_ranks_train_the_same_tables_as_one_rank(tmp_path: pathlib.Path, optimizer):
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(optimizer, str(tmp_path / "pg"), str(out)), nprocs=WORLD, join=True)
    two = torch.load(out)
    one = train(optimizer, 0, 1)
    expected = full_tables(one)
    assert two["tables"].keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(two["tables"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # Rank 0 holds 51 of big's 101 rows and 3 of forced's 5; small (7 rows) is replicated.
    assert two["local_rows"] == {"big": 51 + 3}
    assert two["num_bytes"] < 0.65 * one.num_bytes


def test_sharded_training_moves_the_touched_rows():
    untrained = embedding.EmbeddingCollection(
        embeddings_config(),
        config.SparseOptimizerConfig(name="sgd", lr=0.1),
        device=torch.device("cpu"),
        seed=3,
        world_size=1,
    )
    before = full_tables(untrained)
    after = full_tables(train("sgd", 0, 1))
    for name in ("big.weight", "small.weight", "forced.weight"):
        assert not torch.equal(before[name], after[name]), name


def test_sharded_tables_take_half_the_memory_on_two_ranks_and_still_learn(tmp_path, ckpt_uri):
    cfg = tiny_config(
        checkpoint={"uri": ckpt_uri}, training={"steps": 30}, embeddings={"shard_threshold_rows": 1}
    )
    path = write_config(tmp_path / "c.yaml", cfg)
    code, one, stderr = run_trainer(path)
    assert code == 0, stderr
    cfg["checkpoint"]["uri"] = f"{ckpt_uri}-2"
    code, two, stderr = run_trainer(write_config(path, cfg), nproc=2)
    assert code == 0, stderr
    assert two[0]["embedding_mb"] == pytest.approx(one[0]["embedding_mb"] / 2, rel=0.05)
    assert two[-1]["eval"]["auc"] > 0.6
