"""Process-group setup: torchrun's environment when present, a single process otherwise."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from kembed_contract import threads as thread_policy

__all__ = ["Env", "gather", "rank_threads", "setup", "teardown"]


@dataclasses.dataclass(frozen=True)
class Env:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup(backend: str, threads: int, *, cpu_only: bool = False) -> Env:
    """Join torchrun's group (if any); `cpu_only` for models that train on CPU cores whatever the machine has."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and backend != "gloo" and not cpu_only
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    num_threads = rank_threads(threads, local_world_size=local_world_size)
    torch.set_num_threads(num_threads)
    with contextlib.suppress(RuntimeError):  # torch refuses once its inter-op pool has run (a second setup)
        torch.set_num_interop_threads(num_threads)
    if world_size > 1:
        dist.init_process_group(backend=backend, device_id=device if use_cuda else None)
    return Env(rank, world_size, local_rank, local_world_size, device)


def rank_threads(configured: int, *, local_world_size: int, environ: Mapping[str, str] | None = None) -> int:
    """This rank's threads (torch's intra-op and inter-op pools, a compiled step's workers): the launcher's share
    of the job's cores (kembed_contract.threads), no more than the cores this process may run on shared by the
    node's ranks, which alone decide for a trainer run by hand; `training.threads` when given, held to that (more
    threads than the job was admitted with would run on cores promised to other jobs)."""
    cores = max(1, len(os.sched_getaffinity(0)) // local_world_size)
    share = thread_policy.threads_per_rank(environ)
    limit = cores if share is None else min(share, cores)  # a share larger than the cores placed on would wait
    return min(configured, limit) if configured else limit


def teardown() -> None:
    """Destroy the process groups while the interpreter is whole: whatever still holds one (a DDP model in a
    reference cycle) is collected first, so that the groups' C++ side (gloo's threads) ends here and not in the
    interpreter's own teardown, where it could abort the process."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def gather(t: torch.Tensor) -> torch.Tensor:
    """Concatenate a 1-d tensor of varying length from every rank."""
    if not dist.is_initialized():
        return t
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.empty_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros(width, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes, strict=True)])
