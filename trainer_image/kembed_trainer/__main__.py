"""`python -m kembed_trainer --config PATH_OR_URI`, alone or under torchrun.

Exit codes (kembed_contract.runtime): 0 done; 2 bad input, the config or the data (one line naming the field or
the column, also written to the termination log), a URI outside the storage policy included; 3 a checkpoint
would have passed the tenant's storage quota (the reason in the termination log); 4 out of memory (an
allocation refused: the limit and the size asked for in the termination log); 143 stopped by SIGTERM after a
checkpoint.
"""

from __future__ import annotations

import time

# The trainer's first line: process start ends here and its imports begin (kembed_contract.job_seconds).
_ENTERED_AT = time.time()

import argparse  # noqa: E402  (after the clock, which times them)
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

from kembed_contract import runtime, sizing, storage_policy  # noqa: E402
from kembed_contract import trainer_config as config  # noqa: E402
from kembed_trainer import storage  # noqa: E402

# What bad data raises: a ValueError by convention (pyarrow's parse errors and bad UTF-8 are ValueErrors too), or
# a data file that is not there.
_BAD_DATA = (ValueError, FileNotFoundError)
# A URI outside the launcher's storage policy, found in the config or while running (a file a folder or glob
# turned up, a checkpoint step folder): as final as a bad config.
_DENIED = (storage_policy.StorageDenied, storage_policy.UriError)


def _bad_input(message: str) -> int:
    print(message, file=sys.stderr, flush=True)
    runtime.write_termination_message(message)
    return runtime.EXIT_BAD_CONFIG


def _out_of_memory(exc: BaseException) -> bool:
    """An allocation refused: Python's and NumPy's MemoryError; torch's CPU allocator raises a RuntimeError that
    says "can't allocate memory" (torch 2.13), its GPU allocator torch.OutOfMemoryError."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


class _NoMemoryLimit(ValueError):
    """A tier's cache is to be sized from the job's memory, and the launcher did not say how much that is."""


def _with_tier_caches(cfg: config.TrainerConfig, *, world_size: int) -> config.TrainerConfig:
    """The config with every tier cache the config leaves to the job given in rows: what this rank's memory
    (runtime.ENV_MEMORY_PER_RANK, from the job's resources) leaves after the rest of the estimate, computed as the
    API computed it when it accepted the job (sizing.with_cache_sizes)."""
    auto = sizing.auto_tiered(cfg)
    if not auto:
        return cfg
    memory = runtime.memory_per_rank()
    if memory is None:
        raise _NoMemoryLimit(
            f"embeddings.tables[].tier: table {auto[0].name}'s tier gives no cache size and the launcher gave no "
            f"memory limit ({runtime.ENV_MEMORY_PER_RANK}) to size it from: give its cache_rows or cache_mb")
    return sizing.with_cache_sizes(cfg, world_size=world_size, memory_bytes_per_rank=memory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kembed_trainer", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML or JSON file: a path, file:// or s3:// URI")
    args = parser.parse_args(argv)
    try:
        cfg = config.load_config(args.config)
    except config.ValidationError as exc:
        return _bad_input(f"config error: {config.format_validation_error(exc)}")
    except (OSError, ValueError) as exc:  # unreadable file, YAML syntax, not a mapping
        return _bad_input(f"config error: {exc}".splitlines()[0])
    try:
        # The launcher's policy, whoever wrote the config: every URI canonical and allowed before anything runs.
        guard = storage.Guard.from_env()
        storage_policy.canonicalize_fields(cfg, guard.policy, cwd=os.getcwd())
    except (*_DENIED, ValueError) as exc:
        return _bad_input(f"config error: {exc}".splitlines()[0])

    # Heavy imports only after the config is known to be good, so a typo fails in milliseconds.
    from kembed_trainer import checkpoint, dist, phases, report, train

    clock = phases.PhaseClock.since_launch(_ENTERED_AT)
    with clock.phase("process_start"):  # torchrun's rendezvous: joining the process group
        env = dist.setup(cfg.distributed.backend, cfg.training.threads, cpu_only=cfg.model.cpu_only)
    reporter = report.Reporter.from_env(enabled=env.is_main)
    code = None
    try:
        cfg = _with_tier_caches(cfg, world_size=env.world_size)
        trainer = train.Trainer(cfg, env, reporter, guard=guard, clock=clock)
        try:
            code = trainer.train()
            return code
        finally:
            trainer.close()
            del trainer  # with it the last references to the process groups, which teardown destroys
    except (sizing.CacheTooSmall, _NoMemoryLimit) as exc:
        return _bad_input(f"config error: {exc}".splitlines()[0])
    except _DENIED as exc:
        return _bad_input(f"storage error: {exc}".splitlines()[0])
    except _BAD_DATA as exc:
        return _bad_input(f"data error: {exc}".splitlines()[0])
    except checkpoint.StorageQuotaExceeded as exc:
        message = f"storage quota exceeded: {exc}"
        print(message, file=sys.stderr, flush=True)
        runtime.write_termination_message(message)
        return runtime.EXIT_STORAGE_QUOTA
    except Exception as exc:
        if _out_of_memory(exc):
            traceback.print_exc()
            runtime.write_termination_message(f"{type(exc).__name__}: {exc}".splitlines()[0])
            return runtime.EXIT_OUT_OF_MEMORY
        # A crash keeps its traceback (and exit 1), but the job's message is its one line, not the launcher's.
        runtime.write_termination_message(f"{type(exc).__name__}: {exc}".splitlines()[0])
        raise
    finally:
        # A finished run waits for the API to have its result (the job must not be seen ending without it). A run
        # stopped by SIGTERM (the server stopping, a cancel, a preemption) or failing waits briefly: whoever stops
        # it waits for its exit, its checkpoint is in storage already, and the next attempt reports again.
        reporter.close(flush_s=None if code == runtime.EXIT_OK else report.STOPPED_FLUSH_S)
        dist.teardown()


if __name__ == "__main__":
    from kembed_trainer import quick_exit

    quick_exit.exit_now(main())
