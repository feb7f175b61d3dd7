"""A job's sizes as the API shows them, and the refusal of a job whose ranks cannot fit their memory.

The numbers are the contract's (kembed_contract.sizing), which the trainer uses too: the memory estimate per
rank, the caches of tiers sized from `resources.memory_per_node`, the local disk per node. This module turns a
spec into them with the job's own resources, and says in words why a job cannot fit, naming the field to change.
"""

from __future__ import annotations

from kembed_contract import kinds, sizing
from kembed_contract.spec import JobSpec
from kembed_contract.trainer_config import TrainerConfig

__all__ = ["memory_estimate", "sized_trainer", "tier_cache_rows", "why_memory_cannot_fit"]


def sized_trainer(spec: JobSpec) -> TrainerConfig:
    """The trainer's config as its trainers will size it: every tier cache in rows (sizing.with_cache_sizes).
    Raises sizing.CacheTooSmall when the memory left for a cache cannot hold two steps' rows."""
    r = spec.resources
    return sizing.with_cache_sizes(spec.trainer, world_size=r.num_processes,
                                   memory_bytes_per_rank=r.memory_bytes_per_rank)


def memory_estimate(trainer: TrainerConfig, spec: JobSpec) -> sizing.MemoryEstimate:
    """One rank's estimate of a sized trainer config (`sized_trainer`) at the spec's world size."""
    return sizing.memory_per_rank(trainer, world_size=spec.resources.num_processes)


def tier_cache_rows(trainer: TrainerConfig, spec: JobSpec) -> dict[str, int]:
    """Each tiered table's cache rows per rank, of a sized trainer config."""
    optimizer, world_size = trainer.optimizer.sparse.name, spec.resources.num_processes
    return {t.name: t.tier.cache_rows_for(t, optimizer, world_size=world_size)
            for t in trainer.embeddings.tables if t.tier is not None}


def why_memory_cannot_fit(spec: JobSpec) -> str | None:
    """Why the job's ranks cannot fit `resources.memory_per_node`, naming the field (and, for tables held whole
    in memory, tiering as the way out); None when they fit."""
    try:
        trainer = sized_trainer(spec)
    except sizing.CacheTooSmall as error:
        return str(error)
    r = spec.resources
    estimate = memory_estimate(trainer, spec)
    ranks = r.procs_per_node or 1
    if estimate.total * ranks <= r.memory_bytes_per_node:
        return None
    message = (f"resources.memory_per_node: the job needs about {estimate.describe()}, "
               f"{estimate.total * ranks / 2**30:.2f} GiB for {ranks} rank(s) per node, more than memory_per_node "
               f"({r.memory_per_node})")
    in_memory = {t.name: kinds.table_kind(t).memory_bytes(t, trainer, world_size=r.num_processes)
                 for t in trainer.embeddings.tables if t.tier is None}
    if sum(in_memory.values()) * 2 >= estimate.total:  # tables held whole are most of it: tiering is the way out
        largest = max(in_memory, key=in_memory.__getitem__)
        message += (f"; or keep the rows of its largest table, {largest} ({sizing.in_units(in_memory[largest])} "
                    f"per rank), on the nodes' local disk with only the hot ones in memory: give it a `tier:` "
                    f"section (embeddings.tables[].tier, docs/trainer.md#tiered-tables)")
    return message
