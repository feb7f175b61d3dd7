"""The trainer's runtime contract: what every reader of a trainer (the API, the operator, the local backend, the
CLI) relies on, defined once here and imported by all of them. Standard library only: the API and the operator
import it without torch.

- exit codes of `python -m kembed_trainer` (and of the launcher, kembed_trainer.launch, which passes the first
  failed rank's own code through instead of torchrun's blanket 1);
- the environment a trainer reads (`KEMBED_REPORT_*`, `KEMBED_JOB_ID`, `KEMBED_TERMINATION_LOG`, `KEMBED_STORAGE_POLICY`,
  `KEMBED_STORAGE_BUDGET_BYTES`, `KEMBED_LOCAL_DIR`, `KEMBED_MEMORY_BYTES_PER_RANK`, `KEMBED_KERNEL_CACHE`);
- the termination log: where a failing trainer writes its one-line reason, so the job's message is that reason;
- the names of the records rank 0 reports (JSON lines on stdout, POSTed to the API);
- the checkpoint layout: `<uri>/step-N/`, counting only once its `COMPLETE` marker exists; a marker says whether
  the folder is a full checkpoint or a delta on an earlier one (its parent), and how a chain resolves;
- the command line that starts one node of a gang (torchrun's arguments, under the launcher);
- how much sparse-optimizer state each optimizer keeps per embedding element (sizes shown at submission).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_RECORDS_PER_REPORT",
    "CHECKPOINT_DELTA",
    "CHECKPOINT_FULL",
    "CHECKPOINT_MARKER",
    "CheckpointMarker",
    "ENV_JOB_ID",
    "ENV_KERNEL_CACHE",
    "ENV_LOCAL_DIR",
    "ENV_MEMORY_PER_RANK",
    "ENV_REPORT_TOKEN",
    "ENV_REPORT_URL",
    "ENV_TERMINATION_LOG",
    "ENV_STORAGE_BUDGET",
    "ENV_STORAGE_POLICY",
    "DYNAMIC_TABLE_METRICS",
    "EVENT_CHECKPOINT",
    "EVENT_DONE",
    "EVENT_EVAL",
    "EVENT_PROGRESS",
    "EVENT_STARTED",
    "EXIT_BAD_CONFIG",
    "EXIT_OK",
    "EVAL_SCORE_CHUNK_BYTES",
    "EXIT_OUT_OF_MEMORY",
    "EXIT_REASONS",
    "EXIT_STOPPED",
    "EXIT_STORAGE_QUOTA",
    "MAX_TERMINATION_MESSAGE_BYTES",
    "OPTIMIZER_STATE_FLOATS",
    "TERMINATION_LOG_PATH",
    "KERNEL_CACHE_MODULE",
    "LAUNCHER_MODULE",
    "exit_code",
    "job_checkpoint_folder",
    "latest_checkpoint_reported",
    "memory_per_rank",
    "node_command",
    "chain_of",
    "read_termination_message",
    "restorable_steps",
    "signal_of",
    "steps_needed",
    "step_dir",
    "step_of_dir",
    "storage_budget",
    "write_termination_message",
]

# ---- exit codes ---------------------------------------------------------------------------------------------
def exit_code(returncode: int) -> int:
    """A process's exit status as a shell, torchrun's parent and Kubernetes report it: 128 + N when signal N ended
    it (Python's subprocess and multiprocessing say -N), else its own code. Launchers and backends report this."""
    return 128 - returncode if returncode < 0 else returncode


def signal_of(code: int) -> int | None:
    """The signal N an exit status of 128 + N says ended the process; None for any other status."""
    return code - 128 if code > 128 else None


EXIT_OK = 0
# Bad input: the config does not validate, or the data does not fit it (a missing column, an id outside its
# table, a file that is not there). Retrying cannot help; the reason is in the termination log.
EXIT_BAD_CONFIG = 2
# A checkpoint would have taken the tenant past its storage quota (ENV_STORAGE_BUDGET): that save was dropped, the
# earlier checkpoints are intact. Permanent: a restart would only fail the same way until someone frees space.
EXIT_STORAGE_QUOTA = 3
# An allocation failed: the process reached its memory limit (an rlimit, a GPU's memory) and said so instead of
# being killed. Retrying at the same size cannot help; the reason (how much it asked for) is in the termination log.
EXIT_OUT_OF_MEMORY = 4
EXIT_STOPPED = exit_code(-signal.SIGTERM)  # 143: stopped by SIGTERM after saving a checkpoint (resumes from it)
# Permanent exits whose code alone names why: the job's reason (kembed_contract.lifecycle.judge); any other
# permanent exit is TrainerExitedPermanently, with the termination log's line as its message.
EXIT_REASONS = {EXIT_STORAGE_QUOTA: "StorageQuotaExceeded"}

# ---- environment --------------------------------------------------------------------------------------------
ENV_JOB_ID = "KEMBED_JOB_ID"  # the API's job id (log lines, process lookup after a server restart)
ENV_REPORT_URL = "KEMBED_REPORT_URL"  # where rank 0 POSTs its records; unset: stdout only
ENV_REPORT_TOKEN = "KEMBED_REPORT_TOKEN"  # the per-job bearer token for those POSTs
# A POST may carry the records queued behind one another as a list, at most this many: a job's reports are rate
# limited per request, and a fast job's progress records one at a time waited on that limit, not on training.
MAX_RECORDS_PER_REPORT = 100
# The tenant's storage policy as JSON (kembed_contract.storage_policy), set by the launcher, never by the config;
# unset: a trainer run by hand, not limited.
ENV_STORAGE_POLICY = "KEMBED_STORAGE_POLICY"
ENV_TERMINATION_LOG = "KEMBED_TERMINATION_LOG"  # a file: the first failing rank writes why; unset: nowhere
# Bytes the job's checkpoint folder may hold once a save has landed and the older steps it replaces are pruned:
# the tenant's storage quota less what the tenant keeps elsewhere, counted by the API at launch. Unset: no limit.
ENV_STORAGE_BUDGET = "KEMBED_STORAGE_BUDGET_BYTES"
# A folder on the node's local disk where a trainer keeps scratch files: tiered tables' rows (kembed_trainer.tiered).
# Set by the launcher (a volume of the pod on Kubernetes, a folder under the job's on the embedded backend); unset:
# the system's temporary folder. Never a path from the job's config: a tenant does not choose where on a node the
# trainer writes.
ENV_LOCAL_DIR = "KEMBED_LOCAL_DIR"
# Bytes of memory each rank may use (its node's memory_per_node over its ranks, kembed_contract.spec.Resources), set
# by the launcher: a tier whose cache size the config does not give gets what this leaves after the rest of the
# job's estimate (kembed_contract.sizing.with_cache_sizes). Unset: a trainer run by hand, which must give its sizes.
ENV_MEMORY_PER_RANK = "KEMBED_MEMORY_BYTES_PER_RANK"
# A folder of the trainer's numba kernels compiled by the platform (kembed_trainer.kernel_cache), which the job may
# read and never write: the launcher links its files into the job's own NUMBA_CACHE_DIR. Set by the embedded backend
# and by the trainer image; unset: every job compiles its kernels.
ENV_KERNEL_CACHE = "KEMBED_KERNEL_CACHE"


def memory_per_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """The rank's memory in bytes (`ENV_MEMORY_PER_RANK`); None when unset."""
    value = (os.environ if environ is None else environ).get(ENV_MEMORY_PER_RANK)
    return None if value in (None, "") else max(0, int(value))


def storage_budget(environ: Mapping[str, str] | None = None) -> int | None:
    """The job's storage budget in bytes (`ENV_STORAGE_BUDGET`); None when unset (unlimited)."""
    value = (os.environ if environ is None else environ).get(ENV_STORAGE_BUDGET)
    return None if value in (None, "") else max(0, int(value))

# ---- termination log ----------------------------------------------------------------------------------------
TERMINATION_LOG_PATH = "/dev/termination-log"  # Kubernetes' terminationMessagePath: the kubelet reads it
MAX_TERMINATION_MESSAGE_BYTES = 4096  # what the kubelet keeps of a termination message


def write_termination_message(message: str) -> None:
    """Record why this process fails where the launcher looks (`ENV_TERMINATION_LOG`). The first rank to fail
    writes; later ones (peers that only lost it) leave its message alone."""
    path = os.environ.get(ENV_TERMINATION_LOG)
    if not path:
        return
    with contextlib.suppress(OSError), open(path, "a+b") as f:
        if f.tell() == 0:
            f.write(message.encode("utf-8", "replace")[:MAX_TERMINATION_MESSAGE_BYTES])


def read_termination_message(path: str | os.PathLike) -> str:
    """The message a trainer left at `path`, or "" when there is none.

    The trainer can write the folder, and the server reads this with its own rights: a symlink (or a hard link,
    or a FIFO) there is not a message, so it is not followed (else a trainer could link the server's token here
    and read it back as its job's message)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            return ""
        return f.read(MAX_TERMINATION_MESSAGE_BYTES).decode("utf-8", "replace").strip()


# ---- report records (field "event") -------------------------------------------------------------------------
EVENT_STARTED = "started"  # step = the step it resumed from (0 on a fresh start); resumed_from, total_steps
EVENT_PROGRESS = "progress"  # every log_every steps: loss, samples/s, ...
EVENT_EVAL = "eval"  # evaluation metrics
EVENT_CHECKPOINT = "checkpoint"  # a checkpoint landed completely: uri, num_bytes, seconds
EVENT_DONE = "done"  # the last record of a successful run: eval, checkpoint

DYNAMIC_TABLE_METRICS = {
    "dynamic_rows_in_use": "rows in use",
    "dynamic_admitted": "admitted",
    "dynamic_evicted_capacity": "evicted (full)",
    "dynamic_evicted_ttl": "evicted (time to live)",
}
"""What an `eval` record of a job with dynamic tables says of them, over all ranks and tables (an int each): the
rows that hold an id now, and since the previous eval the ids given rows and the rows freed because the table
was full or their ids went unseen past the time to live. Key -> how `kembed status` labels it."""


def latest_checkpoint_reported(event: str, values: Mapping[str, Any]) -> str | None:
    """The URI of the latest complete checkpoint a record names (its step is the record's), if it names one: a
    `checkpoint` record's `uri`; a `done` record's `last_checkpoint`, else its `checkpoint` (with evaluation.keep_best
    a done record's `checkpoint` is its result's, the best eval's, which may be an earlier step)."""
    if event == EVENT_CHECKPOINT:
        uri = values.get("uri")
    elif event == EVENT_DONE:
        uri = values.get("last_checkpoint") or values.get("checkpoint")
    else:
        return None
    return uri if isinstance(uri, str) else None

# ---- checkpoint layout --------------------------------------------------------------------------------------
CHECKPOINT_MARKER = "COMPLETE"  # written last, by rank 0, once every rank's part is stored
_STEP_DIR = re.compile(r"^step-(\d+)$")


def job_checkpoint_folder(tenant_folder: str, job_id: str) -> str:
    """A job's checkpoint folder when its spec names none: its id under its tenant's own folder (the API's
    `<checkpoint_root>/<tenant>`, which is the Tenant's `s3.prefix` on Kubernetes). One rule for the API, which
    stores it in the spec, and the operator, which fills it in for an EmbeddingJob made without the API."""
    return f"{tenant_folder.rstrip('/')}/{job_id}"


def step_dir(step: int) -> str:
    """The folder (under the job's checkpoint URI) of the checkpoint taken after `step` steps."""
    return f"step-{step}"


def step_of_dir(name: str) -> int | None:
    """The step of a checkpoint folder's name; None for anything else."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


# A full checkpoint holds everything. A delta holds the dense part whole and, of every table, only the rows (and
# their optimizer state and admission counts) that changed since its parent, the checkpoint saved just before it;
# a chain is a full checkpoint and the deltas on it, in order. A step restores only when every link of its chain
# is complete. Markers from before deltas existed (`{"step": N}`) are full checkpoints.
CHECKPOINT_FULL = "full"
CHECKPOINT_DELTA = "delta"


@dataclass(frozen=True)
class CheckpointMarker:
    """What a `COMPLETE` marker says: the step, full or delta, a delta's parent step, and the folder's size."""

    step: int
    kind: str = CHECKPOINT_FULL
    parent: int | None = None  # the step a delta applies on (None for a full checkpoint)
    num_bytes: int | None = None  # the folder's bytes without the marker (None: not recorded)

    def to_bytes(self) -> bytes:
        return json.dumps({"step": self.step, "kind": self.kind, "parent": self.parent,
                           "num_bytes": self.num_bytes}).encode()

    @classmethod
    def parse(cls, step: int, content: bytes) -> CheckpointMarker:
        """The marker of folder `step-<step>`; unreadable or foreign content counts as a full checkpoint's, as an
        empty marker always did."""
        try:
            data = json.loads(content or b"{}")
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        kind = CHECKPOINT_DELTA if data.get("kind") == CHECKPOINT_DELTA else CHECKPOINT_FULL
        parent = data.get("parent") if kind == CHECKPOINT_DELTA else None
        num_bytes = data.get("num_bytes")
        if kind == CHECKPOINT_DELTA and not (isinstance(parent, int) and parent < step):
            kind, parent = CHECKPOINT_DELTA, -1  # a delta whose base cannot be named never restores
        return cls(step, kind, parent, num_bytes if isinstance(num_bytes, int) else None)


def chain_of(step: int, markers: Mapping[int, CheckpointMarker]) -> list[int] | None:
    """The steps to load to restore `step`, oldest (its full checkpoint) first; None when a link is missing.

    `markers`: the complete checkpoints, by step."""
    chain = []
    current: int | None = step
    while current is not None:
        marker = markers.get(current)
        if marker is None:
            return None
        chain.append(current)
        current = marker.parent
    return chain[::-1]


def restorable_steps(markers: Mapping[int, CheckpointMarker]) -> list[int]:
    """Steps whose whole chain is complete, newest first."""
    return sorted((s for s in markers if chain_of(s, markers) is not None), reverse=True)


def steps_needed(steps: Iterable[int], markers: Mapping[int, CheckpointMarker]) -> set[int]:
    """Every folder the chains of `steps` need (what garbage collection must keep to restore each of them)."""
    needed: set[int] = set()
    for step in steps:
        needed.update(chain_of(step, markers) or ())
    return needed


# ---- evaluation's working memory (kembed_trainer.metrics; the API's memory estimate counts it) --------------
# The most an evaluation holds of a queries x candidates score matrix at once (recall@k's positives x items,
# analogy questions x vocabulary), in bytes of float32 scores; the whole matrix at 200,000 items would
# be tens of GB.
EVAL_SCORE_CHUNK_BYTES = 64 * 2**20

# ---- sparse-optimizer state, in floats per embedding element ------------------------------------------------
# adagrad keeps one accumulator per element, row-wise adagrad one per row, adam two moments per element.
OPTIMIZER_STATE_FLOATS = {
    "sgd": lambda dim: 0.0,
    "adagrad": lambda dim: 1.0,
    "rowwise_adagrad": lambda dim: 1.0 / dim,
    "adam": lambda dim: 2.0,
}


# ---- one node of a gang -------------------------------------------------------------------------------------
# What every node runs, `python -m LAUNCHER_MODULE <torchrun arguments>` (kembed_trainer.launch's docstring): the
# local backend's processes and the operator's pods alike.
LAUNCHER_MODULE = "kembed_trainer.launch"
# What builds the platform's kernel cache (ENV_KERNEL_CACHE): `python -m KERNEL_CACHE_MODULE ensure ROOT` prints the
# folder under ROOT that holds this installation's kernels, compiling them first when it is not there.
KERNEL_CACHE_MODULE = "kembed_trainer.kernel_cache"


def node_command(
    launcher: Sequence[str], *, nnodes: int, node_rank: int | str, nproc_per_node: int, master_addr: str,
    master_port: int, config: str, rdzv_id: str | None = None,
) -> list[str]:
    """The command line of one node: the launcher (e.g. `python -m kembed_trainer.launch`, or a copy of it in a
    pod) with torchrun's arguments. Restarts are the platform's (the whole gang, from the checkpoint), never
    torchrun's own, hence `--max-restarts=0`."""
    command = [
        *launcher,
        f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={nproc_per_node}",
        f"--master-addr={master_addr}", f"--master-port={master_port}", "--max-restarts=0",
    ]
    if rdzv_id is not None:
        command.append(f"--rdzv-id={rdzv_id}")
    return [*command, "-m", "kembed_trainer", "--config", config]
