"""A bad config fails at the start, with one line naming the field, and exit code 2."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from kembed_contract import trainer_config as config
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
            {"training": {"steps": 5, "epochs": 2}}, "training: set one of steps and epochs, not both", id="both"
        ),
        pytest.param(
            {"training": {"steps": None}}, "training.steps: synthetic data is endless, set training.steps",
            id="neither-on-synthetic",
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


def data_and_kind(kind: str, **training) -> dict:
    """A config that gives what the data holds and the model's kind, nothing else."""
    features = ["center", "context"] if kind == "text" else ["user", "item"]
    tables = [{"name": f"t_{f}", "num_embeddings": 100, "features": [f]} for f in features]
    model, data = {
        "ratings": ({"kind": "two_tower", "user_features": ["user"], "item_features": ["item"]}, "rating"),
        "clicks": ({"kind": "dlrm"}, "click"),
        "text": ({"kind": "word2vec"}, None),
    }[kind]
    if data is None:
        data = {"kind": "text", "uri": "/corpus.txt"}
    else:
        data = {"kind": "table", "uri": "/rows.parquet", "label": data, "sparse": {f: f for f in features}}
    return {"model": model, "embeddings": {"tables": tables}, "data": data, **({"training": training} if training else {})}


def effective(cfg: config.TrainerConfig, path: str) -> object:
    value: object = cfg
    for name in path.split("."):
        value = getattr(value, name.removesuffix("[]"))
        if name.endswith("[]"):
            value = value[0]
    return value


def test_the_defaults_per_kind_in_the_docs_are_the_configs():
    text = (REPO / "docs" / "trainer.md").read_text()
    section = text.split("### Defaults per kind", 1)[1].split("\n### ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]
    documented = {re.match(r"`([^`]+)`", row[0]).group(1): row[1:] for row in rows}
    assert {p.replace("tables.", "tables[].") for d in config.KIND_DEFAULTS.values() for p in d} <= set(documented)
    for i, kind in enumerate(["ratings", "clicks", "text"]):
        cfg = config.TrainerConfig.model_validate(data_and_kind(kind))
        assert cfg.task == kind
        for path, cells in documented.items():
            cell = cells[i]
            if cell.startswith("("):
                continue  # the kind has no such part
            shown = yaml.safe_load(m.group(1)) if (m := re.match(r"`([^`]+)`", cell)) else yaml.safe_load(cell)
            assert effective(cfg, path) == shown, (kind, path)


@pytest.mark.parametrize("kind", ["ratings", "clicks", "text"])
def test_a_config_of_data_and_kind_validates_to_itself(kind):
    cfg = config.TrainerConfig.model_validate(data_and_kind(kind))
    assert config.TrainerConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def test_what_a_config_gives_is_kept_and_ratings_defaults_follow_its_batch_size():
    cfg = config.TrainerConfig.model_validate(data_and_kind("ratings", batch_size=1024))
    assert (cfg.optimizer.sparse.lr, cfg.embeddings.tables[0].weight_decay) == (0.005 * 1024, 0.02 / 1024)
    given = data_and_kind("ratings", steps=50)
    given["optimizer"] = {"sparse": {"lr": 0.5}}
    given["embeddings"]["tables"][0].update(embedding_dim=33, weight_decay=0.0)
    given["embeddings"]["tables"][1]["embedding_dim"] = 33
    cfg = config.TrainerConfig.model_validate(given)
    assert (cfg.training.steps, cfg.training.epochs, cfg.optimizer.sparse.name, cfg.optimizer.sparse.lr) == (
        50, None, "sgd", 0.5)
    assert [(t.embedding_dim, t.weight_decay) for t in cfg.embeddings.tables] == [(33, 0.0), (33, 0.02 / 256)]
