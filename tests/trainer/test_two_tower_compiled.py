"""two_tower's compiled ratings step: chosen for plain matrix factorisation, it learns planted ratings at 1 and 2
ranks, and resumes bit for bit (from a delta checkpoint too). That it learns what the batch/autograd path learns
is tested on MovieLens-100k (tests/trainer/test_real_data.py)."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from kembed_contract import trainer_config as config
from kembed_trainer import embedding, kinds
from kembed_trainer.data import table
from kembed_trainer.storage import Guard
from tests.trainer.conftest import run_trainer, write_config

NUM_USERS, NUM_ITEMS, NOISE = 300, 120, 0.3


def write_planted_ratings(path: pathlib.Path, num_ratings: int = 24_000, seed: int = 0) -> None:
    """Ratings from rank-3 factors plus user and item biases plus noise of deviation NOISE (a deviation of about
    0.77 in all: what predicting the mean scores; the biases alone, about 0.53)."""
    rng = np.random.default_rng(seed)
    users, items = rng.integers(NUM_USERS, size=num_ratings), rng.integers(NUM_ITEMS, size=num_ratings)
    p, q = rng.normal(0, 0.5, (NUM_USERS, 3)), rng.normal(0, 0.5, (NUM_ITEMS, 3))
    b_user, b_item = rng.normal(0, 0.4, NUM_USERS), rng.normal(0, 0.4, NUM_ITEMS)
    rating = 3.5 + b_user[users] + b_item[items] + (p[users] * q[items]).sum(1) + rng.normal(0, NOISE, num_ratings)
    pq.write_table(pa.table({"user": users, "item": items, "rating": rating.astype(np.float32)}), path)


def ratings_config(data: pathlib.Path, **model) -> dict:
    """The ratings defaults (docs/trainer.md) on the planted ratings: the data and the model kind only."""
    return {
        "model": {"kind": "two_tower", "user_features": ["user"], "item_features": ["item"], **model},
        "embeddings": {"tables": [{"name": "users", "num_embeddings": NUM_USERS, "features": ["user"]},
                                  {"name": "items", "num_embeddings": NUM_ITEMS, "features": ["item"]}]},
        "data": {"kind": "table", "uri": str(data), "label": "rating", "sparse": {"user": "user", "item": "item"},
                 "eval_fraction": 0.1},
        "training": {"threads": 1, "epochs": 4, "log_every": 1},
    }


def compiled_step_of(cfg: dict, tmp_path: pathlib.Path):
    """What two_tower's registry entry trains `cfg` with: its compiled step, or None for the batch path."""
    parsed = config.TrainerConfig.model_validate(cfg)
    data = table.build(parsed, rank=0, world_size=1, guard=Guard(None))
    tables = embedding.EmbeddingCollection(parsed.embeddings, parsed.optimizer.sparse, device=torch.device("cpu"),
                                           seed=0, world_size=1)
    kind = kinds.model("two_tower")
    return kind.compiled_step(parsed, data=data, embeddings=tables, model=kind.dense_model(parsed), total_steps=10,
                              rank=0, world_size=1)


@pytest.mark.parametrize(("model", "optimizer", "compiled"), [
    pytest.param({}, {}, True, id="ratings-defaults"),
    pytest.param({"step": "autograd"}, {}, False, id="asked-for-autograd"),
    pytest.param({"tower_mlp": [8]}, {}, False, id="towers-with-an-mlp"),
    pytest.param({}, {"sparse": {"name": "adam", "lr": 0.01}}, False, id="an-optimizer-it-does-not-run"),
])
def test_the_kind_chooses_the_compiled_step_where_it_trains_the_config_exactly(tmp_path, model, optimizer, compiled):
    write_planted_ratings(tmp_path / "ratings.parquet", num_ratings=1000)
    cfg = {**ratings_config(tmp_path / "ratings.parquet", **model), "optimizer": optimizer}
    assert (compiled_step_of(cfg, tmp_path) is not None) == compiled


def test_asking_for_the_compiled_step_where_it_cannot_train_the_config_is_refused(tmp_path):
    cfg = ratings_config(tmp_path / "ratings.parquet", step="compiled", tower_mlp=[8])
    with pytest.raises(config.ValidationError, match="compiled cannot train this config: the towers have an MLP"):
        config.TrainerConfig.model_validate(cfg)


@pytest.mark.parametrize("nproc", [pytest.param(1, id="one-rank"), pytest.param(2, id="two-ranks")])
def test_planted_ratings_are_learnt_and_a_resume_from_a_delta_replays_the_run(tmp_path, nproc):
    """Learnt at 1 and 2 ranks (each rank trains its share; their changes are added up every step), and a run resumed from a delta checkpoint (rows other ranks moved included) repeats the rest bit for bit."""
    write_planted_ratings(tmp_path / "ratings.parquet")
    cfg = ratings_config(tmp_path / "ratings.parquet")
    cfg["checkpoint"] = {"uri": f"file://{tmp_path}/ckpt", "every_steps": 40, "keep": 10, "incremental": True,
                         "full_every": 2}
    path = write_config(tmp_path / "c.yaml", cfg)
    code, straight, stderr = run_trainer(path, nproc=nproc)
    assert code == 0, stderr
    assert straight[0]["world_size"] == nproc
    total = straight[0]["total_steps"]
    rmse = straight[-1]["eval"]["rmse"]
    assert rmse < 0.6, rmse  # the mean would score about 0.77

    steps = sorted(int(p.name.removeprefix("step-")) for p in (tmp_path / "ckpt").glob("step-*"))
    assert steps[:2] == [40, 80]
    for step in steps[2:]:  # back to step 80, a delta on step 40's full checkpoint, as if the job had died there
        shutil.rmtree(tmp_path / "ckpt" / f"step-{step}")
    code, resumed, stderr = run_trainer(path, nproc=nproc)
    assert code == 0, stderr
    assert resumed[0]["resumed_from"].endswith("/step-80")
    losses = {r["step"]: r["loss"] for r in straight if r["event"] == "progress"}
    again = {r["step"]: r["loss"] for r in resumed if r["event"] == "progress"}
    assert list(again) == list(range(81, total + 1))
    assert again == {s: losses[s] for s in again}  # bit for bit
    assert resumed[-1]["eval"]["rmse"] == rmse


def test_a_compiled_steps_checkpoint_resumes_on_the_batch_path(tmp_path):
    """A compiled step keeps no dense optimizer state; the batch path (where `auto` falls back, on a GPU) resumes
    its checkpoint all the same, with the global bias it learnt and a fresh dense optimizer."""
    write_planted_ratings(tmp_path / "ratings.parquet", num_ratings=6000)
    cfg = ratings_config(tmp_path / "ratings.parquet")
    cfg["checkpoint"] = {"uri": f"file://{tmp_path}/ckpt", "every_steps": 20}
    code, compiled, stderr = run_trainer(write_config(tmp_path / "compiled.yaml", cfg))
    assert code == 0, stderr
    cfg["training"] = {**cfg["training"], "epochs": 6}
    cfg["model"] = {**cfg["model"], "step": "autograd"}
    code, resumed, stderr = run_trainer(write_config(tmp_path / "autograd.yaml", cfg))
    assert code == 0, stderr
    assert resumed[0]["resumed_from"].endswith(f"/step-{compiled[0]['total_steps']}")
    first = next(r for r in resumed if r["event"] == "progress")
    # Picked up where the compiled step left off (a global bias at zero would cost the mean rating, ~3.5, squared).
    assert first["loss"] < 2 * compiled[-1]["eval"]["rmse"] ** 2, first
