"""Dynamic sparse masks over the dense weights, and bf16 for the dense part (where it is the default)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from kembed_contract import trainer_config as config
from kembed_trainer import dist, precision, report, sparsity, train
from tests.trainer.conftest import tiny_config


def make_trainer(cfg: dict) -> tuple[train.Trainer, io.StringIO]:
    out = io.StringIO()
    trainer = train.Trainer(
        config.TrainerConfig.model_validate(cfg),
        dist.setup("gloo", threads=1),
        report.Reporter(enabled=True, out=out),
    )
    return trainer, out


def run_steps(trainer: train.Trainer, n: int) -> None:
    for _ in range(n):
        trainer.train_step()
        trainer.step += 1


def test_schedule_is_dense_then_rises_to_its_target():
    cfg = config.SparsityConfig(target=0.75, dense_until=100, increase=0.2, increase_every=50)
    fractions = [sparsity.masked_fraction(cfg, s) for s in (0, 99, 100, 149, 150, 200, 250, 10_000)]
    assert fractions == [0.0, 0.0, 0.2, 0.2, 0.4, 0.6, 0.75, 0.75]


def test_masked_weights_stay_fixed_until_the_masks_are_chosen_again():
    cfg = tiny_config(
        sparsity={"method": "score", "target": 0.5, "dense_until": 5, "every_steps": 10},
        checkpoint={"uri": None},
    )
    trainer, _ = make_trainer(cfg)
    run_steps(trainer, 6)  # masks chosen at step 5 (0-based)
    params = trainer.masks.params
    before = {n: p.detach().clone() for n, p in params.items()}
    masks = {n: m.clone() for n, m in trainer.masks.masks.items()}
    run_steps(trainer, 9)  # steps 6..14: no re-selection
    for name, p in params.items():
        masked = ~masks[name]
        assert masked.float().mean().item() == pytest.approx(0.5, abs=0.02), name
        assert torch.all(p.detach()[masked] == 0), name  # masked weights are zero and stayed there
        assert not torch.equal(p.detach()[masks[name]], before[name][masks[name]]), name  # the rest trained
    run_steps(trainer, 1)  # step 15: chosen again, by weights and gradients
    assert trainer.masks.churn > 0


def test_progress_records_show_the_schedule_reaching_its_target():
    cfg = tiny_config(
        sparsity={"method": "topk", "target": 0.9, "dense_until": 10, "increase": 0.25, "increase_every": 10},
        training={"steps": 60, "log_every": 10},
        checkpoint={"uri": None},
    )
    trainer, out = make_trainer(cfg)
    assert trainer.train() == 0
    recs = [json.loads(line) for line in out.getvalue().splitlines()]
    density = [r["mask_density"]["top.0.weight"] for r in recs if r["event"] == "progress"]
    # After steps 10, 20, ...: dense for 10 steps, then 25%, 50%, 75%, 90%, 90% masked.
    assert density == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.1, 0.1], abs=0.01)
    assert recs[-1]["eval"]["auc"] > 0.6


@pytest.mark.parametrize("method", ["topk", "random", "score"])
def test_block_masks_are_made_of_whole_blocks(method):
    cfg = tiny_config(
        sparsity={"method": method, "target": 0.5, "block_size": 4, "every_steps": 3},
        checkpoint={"uri": None},
    )
    trainer, _ = make_trainer(cfg)
    run_steps(trainer, 4)  # chosen at step 0, again at step 3
    for name, mask in trainer.masks.masks.items():
        rows, cols = mask.shape
        for r in range(0, rows, 4):
            for c in range(0, cols, 4):
                block = mask[r : r + 4, c : c + 4]
                assert block.all() or not block.any(), f"{name} block ({r}, {c}) is split"
        if mask.numel() >= 64:
            assert 0.3 < mask.float().mean().item() < 0.7, name


def test_bf16_dense_part_learns_and_tables_stay_float32():
    cfg = tiny_config(training={"mixed_precision": "bf16", "log_every": 1}, checkpoint={"uri": None})
    trainer, out = make_trainer(cfg)
    assert trainer.train() == 0
    recs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert recs[-1]["eval"]["auc"] > 0.7
    assert all(g.weight.dtype == torch.float32 for g in trainer.embeddings.groups)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())

    plain, out32 = make_trainer(tiny_config(training={"mixed_precision": "none", "log_every": 1},
                                            checkpoint={"uri": None}))
    assert plain.train() == 0
    losses = [r["loss"] for r in recs if r["event"] == "progress"]
    losses32 = [json.loads(line)["loss"] for line in out32.getvalue().splitlines() if '"progress"' in line]
    assert losses != losses32  # the dense part really ran in bf16
    assert losses[-1] == pytest.approx(losses32[-1], abs=0.05)


@pytest.mark.parametrize(
    ("flags", "bf16"),
    [
        pytest.param({"avx512f", "avx512bw", "avx512_bf16"}, True, id="avx512-bf16"),
        pytest.param({"amx_bf16", "amx_tile"}, True, id="amx"),
        pytest.param({"avx512f", "avx512bw", "avx512vl"}, False, id="avx512-without-bf16"),
        pytest.param(set(), False, id="no-cpuinfo"),
    ],
)
def test_auto_precision_is_bf16_only_on_cpus_with_bf16_units(monkeypatch, flags, bf16):
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset(flags))
    cast = precision.autocast("auto", torch.device("cpu"))
    assert cast._enabled is bf16 and (not bf16 or cast.fast_dtype == torch.bfloat16)
    assert precision.autocast("bf16", torch.device("cpu"))._enabled  # asked for: whatever the CPU
    assert not precision.autocast("none", torch.device("cpu"))._enabled


def test_clicks_default_to_auto_precision_and_ratings_to_float32():
    dlrm = config.TrainerConfig.model_validate(tiny_config())
    assert dlrm.training.mixed_precision == "auto"
    assert config.TrainerConfig.model_validate(
        tiny_config(training={"mixed_precision": "none"})).training.mixed_precision == "none"
    ratings = config.TrainerConfig.model_validate(
        tiny_config(model={"kind": "two_tower", "user_features": ["c0", "c1", "c2", "c3"],
                           "item_features": ["c4", "c5", "c6", "c7"]}))
    assert ratings.ratings and ratings.training.mixed_precision == "none"
