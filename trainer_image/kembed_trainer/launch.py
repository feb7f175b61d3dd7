"""torchrun, with the failed rank's own exit code (runs inside the trainer image: stdlib, torch, kembed_contract.runtime).

torchrun exits 1 whatever happened to its workers, which would hide the difference between a bad config (exit 2,
permanent), a crash (1, permanent) and a kill (137) or a SIGTERM checkpoint (143, both retryable). Trainer pods
and the local backend both run it as `python -m kembed_trainer.launch <torchrun arguments>`: the same
arguments, the same launch code (torch.distributed.run.run), but the process then exits with
- the first failed worker's exit code (128 + N when a signal N killed it), or 2 when any worker exited 2 (bad
  config or data: its peers then often fail only because it left, and sometimes before it is noticed), or else 4
  when any worker ran out of memory (for the same reason),
- 128 + N when the launcher itself got signal N (SIGTERM: the workers were asked to checkpoint and stop),
- 0 when every worker succeeded.

A node of one process in a gang of one node skips torchrun: the launcher starts that rank itself
(kembed_trainer.lone_rank), under the same policy. Either way the ranks find the platform's compiled kernels
(kembed_trainer.kernel_cache.expose).
"""

import time

_STARTED_AT = time.time()  # before the rest of the launcher's imports: they are process start too

import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from kembed_contract.job_seconds import ENV_LAUNCHED_AT  # noqa: E402
from kembed_contract.runtime import EXIT_BAD_CONFIG, EXIT_OUT_OF_MEMORY, exit_code  # noqa: E402
from kembed_trainer import kernel_cache, lone_rank  # noqa: E402


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    # The workers inherit it: their process start counts from here (kembed_contract.job_seconds).
    os.environ[ENV_LAUNCHED_AT] = repr(_STARTED_AT)
    if exposed := kernel_cache.expose(os.environ):
        print(f"kembed launcher: {exposed}", file=sys.stderr, flush=True)
    alone = lone_rank.parse(argv)
    if alone is not None:
        return lone_rank.run(alone)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as failed:
        telling = [sorted((r, f) for r, f in failed.failures.items() if f.exitcode == code)
                   for code in (EXIT_BAD_CONFIG, EXIT_OUT_OF_MEMORY)]
        rank, failure = next((t[0] for t in telling if t), None) or failed.get_first_failure()
        code = exit_code(failure.exitcode)  # a negative exit code is the signal that ended the worker
        print(f"kembed launcher: rank {rank} failed, exit code {code}", file=sys.stderr, flush=True)
        return code or 1
    except SignalException as stopped:
        print(f"kembed launcher: stopped by {signal.Signals(stopped.sigval).name}", file=sys.stderr, flush=True)
        return exit_code(-int(stopped.sigval))
    return 0


if __name__ == "__main__":
    sys.exit(main())
