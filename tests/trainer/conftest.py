"""Builders and runners for trainer tests: configs from the shipped examples, the trainer as a subprocess."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import yaml

from kembed_contract import runtime

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "trainer_image" / "examples"


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """The shipped tiny example with sections updated: tiny_config(training={"steps": 5}).

    A section given with another `kind` (model={"kind": "two_tower", ...}) replaces the example's section.
    """
    cfg = yaml.safe_load((EXAMPLES / "dlrm-tiny.yaml").read_text())
    for section, values in overrides.items():
        same_kind = values.get("kind", cfg.get(section, {}).get("kind")) == cfg.get(section, {}).get("kind")
        if isinstance(values, dict) and same_kind:
            cfg.setdefault(section, {}).update(copy.deepcopy(values))
        else:
            cfg[section] = copy.deepcopy(values)
    return cfg


def write_config(path: pathlib.Path, cfg: dict[str, Any]) -> pathlib.Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def trainer_command(config_path: pathlib.Path, nproc: int = 1) -> list[str]:
    module = ["-m", "kembed_trainer", "--config", str(config_path)]
    if nproc == 1:
        return [sys.executable, *module]
    return [
        sys.executable,
        "-m",
        "kembed_trainer.launch",  # torchrun, exiting with the failed rank's own code
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        *module,
    ]


def trainer_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "KEMBED_JOB_ID": "test-job", **extra}
    env.pop("KEMBED_REPORT_URL", None)
    return env


def records(stdout: str) -> list[dict[str, Any]]:
    """The JSON-line records of rank 0 (torchrun may add other lines)."""
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            rec = json.loads(line)
            if "event" in rec:
                out.append(rec)
    return out


def run_trainer(config_path: pathlib.Path, nproc: int = 1, timeout: float = 120, **env: str):
    proc = subprocess.run(  # noqa: PLW1510 - the exit code is what we test
        trainer_command(config_path, nproc),
        env=trainer_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    return proc.returncode, records(proc.stdout), proc.stderr


def run_trainer_to_its_reason(config_path: pathlib.Path, nproc: int = 1, **env: str) -> tuple[int, str, str]:
    """Run the trainer and return its exit code, the reason it wrote to its termination log, and its stderr."""
    termination_log = config_path.with_name(f"{config_path.stem}.termination-log")
    code, _, stderr = run_trainer(config_path, nproc, **{runtime.ENV_TERMINATION_LOG: str(termination_log)}, **env)
    return code, termination_log.read_text() if termination_log.exists() else "", stderr


@pytest.fixture
def ckpt_uri(tmp_path: pathlib.Path) -> str:
    return f"file://{tmp_path}/ckpt"
