"""A trainer run inside the benchmark's own process (no launcher, one rank), for benchmarks that time the training
alone: its records and its wall seconds."""

from __future__ import annotations

import io
import json
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer_image"))
sys.path.insert(0, str(REPO))

from kembed_contract import trainer_config as config  # noqa: E402 - after the path insert
from kembed_trainer import dist, report, train  # noqa: E402

__all__ = ["train_in_process"]


def train_in_process(cfg: dict, threads: int) -> tuple[list[dict], float]:
    """Train the trainer config `cfg` on `threads` threads; every record it wrote, and the seconds it took."""
    env = dist.setup("gloo", threads)
    out = io.StringIO()
    started = time.perf_counter()
    trainer = train.Trainer(config.TrainerConfig.model_validate(cfg), env, report.Reporter(enabled=True, out=out))
    try:
        trainer.train()
    finally:
        trainer.close()
    seconds = time.perf_counter() - started
    return [json.loads(line) for line in out.getvalue().splitlines()], seconds
