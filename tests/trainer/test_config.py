"""A bad config fails at the start, with one line naming the field, and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kembed_trainer import config
from tests.trainer.conftest import EXAMPLES, REPO, tiny_config, write_config


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_shipped_examples_validate(example):
    cfg = config.load_config(str(EXAMPLES / example))
    assert (cfg.training.steps or cfg.training.epochs) > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            {"training": {"steps": 0}}, "training.steps: Input should be greater than 0", id="zero-steps"
        ),
        pytest.param({"training": {"stepz": 5}}, "training.stepz: Extra inputs are not permitted", id="typo"),
        pytest.param(
            {"optimizer": {"sparse": {"name": "lamb"}}},
            "optimizer.sparse.name: Input should be",
            id="unknown-sparse-optimizer",
        ),
        pytest.param(
            {"model": {"kind": "gpt"}},
            "model: Input tag 'gpt' found using 'kind' does not match",
            id="unknown-model-kind",
        ),
        pytest.param(
            {"data": {"kind": "synthetic", "min_hotness": 3, "max_hotness": 2}},
            "data.synthetic: max_hotness must be >= min_hotness",
            id="hotness-order",
        ),
        pytest.param(
            {"checkpoint": {"uri": "gs://bucket/x"}},
            "checkpoint.uri: only file:// and s3://",
            id="unsupported-scheme",
        ),
        pytest.param(
            {"sparsity": {"target": 1.0}},
            "sparsity.target: Input should be less than 1",
            id="sparsity-target",
        ),
        pytest.param(
            {"sparsity": {"target": 0.5, "method": "magnitude"}},
            "sparsity.method: Input should be",
            id="mask-method",
        ),
        pytest.param(
            {"training": {"mixed_precision": "fp8"}},
            "training.mixed_precision: Input should be",
            id="precision",
        ),
        pytest.param(
            {"embeddings": {"shard_threshold_rows": 0}},
            "embeddings.shard_threshold_rows: Input should be greater than 0",
            id="shard-threshold",
        ),
        pytest.param(
            {"training": {"steps": 5, "epochs": 2}}, "training: set exactly one of steps and epochs", id="both"
        ),
        pytest.param(
            {"training": {"steps": None}}, "training: set exactly one of steps and epochs", id="neither"
        ),
        pytest.param(
            {"training": {"steps": None, "epochs": 2}},
            "training.epochs: synthetic data is endless, set training.steps instead",
            id="epochs-of-synthetic",
        ),
        pytest.param(
            {"model": {"kind": "dlrm", "bottom_mlp": [16, 4]}},
            "dlrm: bottom_mlp must end in the embedding_dim",
            id="bottom-mlp-width",
        ),
    ],
)
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(config.ValidationError) as err:
        config.TrainerConfig.model_validate(tiny_config(**overrides))
    assert message in config.format_validation_error(err.value)


def test_bad_config_exits_2_with_one_line(tmp_path):
    path = write_config(tmp_path / "bad.yaml", tiny_config(training={"steps": -1}))
    proc = subprocess.run(  # noqa: PLW1510 - the exit code is what we test
        [sys.executable, "-m", "kembed_trainer", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "config error: training.steps: Input should be greater than 0"
    assert proc.stdout == ""


def test_missing_config_file_exits_2(tmp_path):
    proc = subprocess.run(  # noqa: PLW1510 - the exit code is what we test
        [sys.executable, "-m", "kembed_trainer", "--config", str(tmp_path / "nope.yaml")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("config error:")
