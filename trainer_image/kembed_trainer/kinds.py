"""The trainer's halves of the kinds, found by the names the contract registers (`kembed_contract.kinds`).

A model kind's trainer half is `kembed_trainer.models.<kind>` (`KIND = <its models.base.ModelTraining>`), a data
kind's `kembed_trainer.data.<kind>` (`build(cfg, *, rank, world_size, guard)` -> its source), a table kind's
`kembed_trainer.tables.<kind>` (`KIND = <its tables.base.TableStorage>`). Nothing else in the trainer names a
kind: it asks here. docs/architecture.md, "Adding a kind".
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

from kembed_contract import kinds
from kembed_contract import trainer_config as config
from kembed_trainer.models.base import ModelTraining, Writer
from kembed_trainer.storage import Guard
from kembed_trainer.tables.base import TableStorage

__all__ = ["data_source", "export_writers", "kernel_modules", "model", "table"]


@functools.cache
def _half(package: str, name: str) -> ModuleType:
    try:
        return importlib.import_module(f"kembed_trainer.{package}.{name}")
    except ModuleNotFoundError as missing:
        if missing.name != f"kembed_trainer.{package}.{name}":
            raise
        raise ImportError(f"kind {name!r} has no trainer half (kembed_trainer.{package}.{name})") from None


def model(name: str) -> ModelTraining:
    """The trainer half of model kind `name`."""
    kind = _half("models", name).KIND
    assert isinstance(kind, ModelTraining), f"kembed_trainer.models.{name}.KIND"
    return kind


def data_source(cfg: config.TrainerConfig, *, rank: int, world_size: int, guard: Guard) -> Any:
    """The source of `cfg.data`'s kind: `train_batch(step) -> Batch` and `eval_batches() -> Iterator[Batch]`;
    files are read through `guard` (the storage policy)."""
    return _half("data", cfg.data.kind).build(cfg, rank=rank, world_size=world_size, guard=guard)


def table(table_cfg: config.TableConfig) -> TableStorage:
    """How a table of `table_cfg`'s kind is held."""
    return _table(kinds.table_kind(table_cfg).kind_name())


def _table(name: str) -> TableStorage:
    kind = _half("tables", name).KIND
    assert isinstance(kind, TableStorage), f"kembed_trainer.tables.{name}.KIND"
    return kind


def export_writers() -> dict[str, Writer]:
    """A writer for every export format a model kind adds."""
    return {fmt: writer for name in kinds.MODELS for fmt, writer in model(name).writers.items()}


def kernel_modules(cfg: config.TrainerConfig | None = None) -> list[str]:
    """Every module with cached numba kernels, of every model kind and table kind (what kembed_trainer.kernel_cache
    compiles); of `cfg`'s model kind and the kinds of its tables alone when given (what a job may use)."""
    if cfg is None:
        halves = [*(model(name) for name in kinds.MODELS), *(_table(name) for name in kinds.TABLES)]
    else:
        halves = [model(cfg.model.kind), *(table(t) for t in cfg.embeddings.tables)]
    return sorted({module for half in halves for module in half.kernel_modules})
