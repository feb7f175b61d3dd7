"""A node that runs one process, started without torchrun (stdlib only: runs inside the launcher, before torch).

torchrun earns its cost when a node has several ranks or the gang several nodes: it starts the ranks, runs the
rendezvous and watches them. A node of one process in a gang of one node has nothing to rendezvous with, yet
torchrun costs it an import of torch in the launcher, an agent and its store, and a poll of the rank's exit. Here
the launcher starts that one rank itself, with the environment torchrun would give it, forwards the signals it gets
(a pod's SIGTERM reaches the launcher alone, as under torchrun the rank runs in a session of its own) and exits
with the rank's code under the launcher's one policy (kembed_trainer.launch).

Only arguments this module fully understands take this path; anything else (several nodes or processes, an
elastic range, restarts, an option it does not know) goes to torchrun as before.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kembed_contract.runtime import exit_code

__all__ = ["LoneRank", "parse", "rank_environ", "run"]

# The signals a launcher passes on to its ranks, as torchrun's agent does.
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_DEFAULT_MASTER_ADDR = "127.0.0.1"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class LoneRank:
    """The one rank to start: its command line (after the interpreter) and where a process group would meet."""

    command: list[str]
    master_addr: str
    master_port: int | None  # None: any free port (torchrun's --standalone picks one too)


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # not ours to report: torchrun parses these arguments again and says why
        raise _Refused(message)


def _parser() -> _Parser:
    parser = _Parser(add_help=False, allow_abbrev=False)
    # torchrun's spellings of the options the platform's node command uses (kembed_contract.runtime.node_command).
    for names in (("--nnodes",), ("--nproc-per-node", "--nproc_per_node"), ("--node-rank", "--node_rank"),
                  ("--master-addr", "--master_addr"), ("--master-port", "--master_port"),
                  ("--max-restarts", "--max_restarts"), ("--rdzv-id", "--rdzv_id")):
        parser.add_argument(*names, dest=names[0].lstrip("-").replace("-", "_"))
    parser.add_argument("--standalone", action="store_true")
    parser.add_argument("-m", "--module", action="store_true")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def parse(argv: Sequence[str]) -> LoneRank | None:
    """The rank to start when torchrun's arguments `argv` ask for one node of one process and no restarts; None
    when they ask for anything else or say something this module does not know (torchrun then runs)."""
    try:
        known, unknown = _parser().parse_known_args(list(argv))
    except _Refused:
        return None
    if unknown or known.nnodes != "1" or known.nproc_per_node != "1" or known.max_restarts not in (None, "0"):
        return None
    if known.node_rank not in (None, "0"):
        return None
    try:
        port = None if known.master_port is None else int(known.master_port)
    except ValueError:
        return None
    target = ["-m", known.script] if known.module else [known.script]
    return LoneRank(command=[*target, *known.script_args], master_addr=known.master_addr or _DEFAULT_MASTER_ADDR,
                    master_port=port)


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def rank_environ(rank: LoneRank, environ: dict[str, str]) -> dict[str, str]:
    """The rank's environment: the launcher's, with what torchrun tells a worker of a one-process gang."""
    port = rank.master_port if rank.master_port is not None else _free_port(rank.master_addr)
    return {**environ, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": rank.master_addr, "MASTER_PORT": str(port)}


def _die_with_the_launcher() -> None:
    """In the rank, before it runs: SIGKILL it should the launcher die first (a launcher killed without a chance to
    pass a signal on must not leave its rank training on, in a session where its node's signals do not reach)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def run(rank: LoneRank) -> int:
    """Start the rank, pass signals on to it, and return the launcher's exit code: the rank's own (128 + N when
    signal N ended it), or 128 + N when the launcher itself got signal N (the rank was asked to stop: it saves a
    checkpoint first, and the launcher waits for it, as long as whoever sent the signal allows)."""
    received: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        if child is not None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        child = subprocess.Popen([sys.executable, *rank.command], env=rank_environ(rank, dict(os.environ)),
                                 start_new_session=True,
                                 preexec_fn=_die_with_the_launcher if sys.platform.startswith("linux") else None)
        for signum in received:  # arrived while it was being started
            child.send_signal(signum)
        code = exit_code(child.wait())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        print(f"kembed launcher: stopped by {signal.Signals(received[0]).name}", file=sys.stderr, flush=True)
        return exit_code(-received[0])
    if code:
        print(f"kembed launcher: rank 0 failed, exit code {code}", file=sys.stderr, flush=True)
    return code
