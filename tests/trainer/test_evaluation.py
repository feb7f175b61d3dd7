"""Evaluation that fits the model, the best checkpoint kept as the job's result, and early stopping."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch

from kembed_contract import trainer_config as config
from kembed_trainer import best, metrics
from kembed_trainer.models.word2vec import word_eval
from kembed_trainer.storage import Guard
from tests.trainer.conftest import run_trainer, tiny_config, write_config


def test_the_best_eval_is_tracked_by_its_metrics_direction():
    tracker = best.Best("rmse", higher_is_better=False, patience=2, metrics=["rmse", "mae", "loss"])
    assert tracker.update(10, {"rmse": 1.0, "mae": 0.8, "loss": 1.0})
    assert tracker.update(20, {"rmse": 0.9, "mae": 0.7, "loss": 0.81})
    assert not tracker.update(30, {"rmse": 0.95, "mae": 0.6, "loss": 0.9}) and not tracker.should_stop
    assert not tracker.update(40, {"rmse": 0.91, "mae": 0.6, "loss": 0.83}) and tracker.should_stop
    assert tracker.best_step == 20 and tracker.result() == {"loss": 0.81, "mae": 0.7, "rmse": 0.9}


@pytest.mark.parametrize(("cfg", "metric", "higher"), [
    pytest.param({"model": {"kind": "two_tower", "user_features": ["c0"], "item_features": ["c1"]}},
                 "rmse", False, id="ratings"),
    pytest.param({}, "auc", True, id="clicks"),
    pytest.param({"evaluation": {"metric": "log_loss"}}, "log_loss", False, id="chosen"),
])
def test_the_best_metric_and_its_direction_follow_the_model(cfg, metric, higher):
    overrides = dict(cfg)
    if "model" in overrides:
        overrides["embeddings"] = {"tables": [
            {"name": "u", "num_embeddings": 10, "embedding_dim": 4, "features": ["c0"]},
            {"name": "i", "num_embeddings": 10, "embedding_dim": 4, "features": ["c1"]}]}
        overrides["data"] = {"kind": "synthetic", "num_dense": 0}
    parsed = config.TrainerConfig.model_validate(tiny_config(**overrides))
    assert parsed.best_metric == (metric, higher)


def test_a_metric_the_model_does_not_report_is_refused():
    with pytest.raises(config.ValidationError, match="dlrm reports"):
        config.TrainerConfig.model_validate(tiny_config(evaluation={"metric": "rmse"}))


def test_recall_at_k_ranks_each_positive_among_the_held_out_items():
    items = torch.eye(3)
    # Rows (user, item, label): the third user's item is 1 but it scores item 2 higher; the last row is a negative,
    # whose item still counts as a candidate.
    user = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0.4, 0.5], [1.0, 0, 0]])
    labels = torch.tensor([1.0, 1.0, 1.0, 0.0])
    item_of_row = items[[0, 1, 1, 2]]
    assert metrics.recall_at_k(user, item_of_row, torch.zeros(4), labels, k=1) == pytest.approx(2 / 3)
    assert metrics.recall_at_k(user, item_of_row, torch.zeros(4), labels, k=2) == 1.0
    assert metrics.recall_at_k(user, item_of_row, torch.tensor([0, 0, 0, -1.0]), labels, k=1) == 1.0  # bias


@pytest.mark.parametrize("chunk_bytes", [pytest.param(4, id="one-positive-at-a-time"),
                                         pytest.param(4 * 300 * 7, id="seven-positives-at-a-time")])
def test_recall_at_k_in_chunks_is_the_recall_of_the_whole_matrix(chunk_bytes):
    """Scoring positives a chunk at a time (bounded memory) gives exactly the answer of one whole score matrix."""
    generator = torch.Generator().manual_seed(7)
    rows, width, num_items = 500, 8, 300
    items = torch.randn(num_items, width, generator=generator)
    which = torch.randint(num_items, (rows,), generator=generator)
    user = torch.randn(rows, width, generator=generator)
    bias = torch.randn(num_items, generator=generator)[which]
    labels = (torch.rand(rows, generator=generator) < 0.6).float()
    for k in (1, 10, 50):
        whole = metrics.recall_at_k(user, items[which], bias, labels, k, chunk_bytes=2**40)
        assert metrics.recall_at_k(user, items[which], bias, labels, k, chunk_bytes=chunk_bytes) == whole
        assert 0 < whole < 1


def test_analogies_and_neighbours_from_word_vectors(tmp_path: pathlib.Path):
    vocab = ["king", "queen", "man", "woman", "apple", "pear"]
    vectors = torch.tensor([[1.0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 0.1], [0, 0, 1, 0.1], [0, 0, 0, 1], [0, 0, 0.1, 1]])
    (tmp_path / "q.txt").write_text(": family\nman woman king queen\nman king woman queen\nman dog king cat\n")
    checks = word_eval.WordEval(vocab, neighbours_of=["apple", "nope"], k=1, analogies_uri=str(tmp_path / "q.txt"),
                                guard=Guard(None))
    out = checks(vectors)
    assert out["neighbours"] == {"apple": ["pear"]}
    assert out["analogy_questions"] == 2 and out["analogy_accuracy"] == 1.0


@pytest.mark.slow
def test_the_job_keeps_its_best_checkpoint_as_its_result_and_stops_when_patience_runs_out(tmp_path, ckpt_uri):
    # Pure-noise labels: the eval AUC wanders around 0.5, so the best is rarely the last and patience runs out.
    cfg = tiny_config(
        data={"signal": 0.0, "eval_samples": 2048},
        training={"steps": 300, "eval_every": 10, "log_every": 50},
        checkpoint={"uri": ckpt_uri, "every_steps": 10, "keep": 1},
        evaluation={"patience": 3},
    )
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg))
    assert code == 0, stderr
    evals = [r for r in recs if r["event"] == "eval"]
    done = recs[-1]
    assert {"auc", "log_loss", "loss"} <= set(evals[0])
    best_eval = max(evals, key=lambda r: (r["auc"], -r["step"]))  # the first of equals stays the best
    assert done["best_step"] == best_eval["step"] and done["eval"]["auc"] == best_eval["auc"]
    assert [r["step"] for r in evals if r["best"]][-1] == best_eval["step"]
    # Patience: three evals in a row without a better AUC, then it stopped (or the steps ran out).
    assert done["step"] == min(300, best_eval["step"] + 3 * 10)
    assert done["stopped_early"] == (done["step"] < 300)
    root = pathlib.Path(ckpt_uri.removeprefix("file://"))
    complete = sorted(int(p.parent.name[5:]) for p in root.glob("step-*/COMPLETE"))
    assert complete == sorted({best_eval["step"], done["step"]})  # keep: 1 never deletes the best
    assert done["checkpoint"].endswith(f"/step-{best_eval['step']}")
    assert done["last_checkpoint"].endswith(f"/step-{done['step']}")
    assert not math.isnan(done["eval"]["log_loss"])
