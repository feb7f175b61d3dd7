"""One read of a checkpoint for the API, in a process of its own: an export file, or a word's nearest neighbours.

    python -m kembed_trainer.export_worker STEP_URI (--format FORMAT | --neighbours WORD [-k K]) [--table T]

A tenant's trainer wrote the checkpoint, so the API never reads it itself (docs/security.md): it runs this under
`kembed_api.jobs.checkpoint_reader` (Landlock, a clean environment, resource limits) and reads back stdout:
one JSON line, then for an export the file's bytes. The line is `{"table": ..., "num_bytes": ...}` (the
file's size), or `{"table": ..., "neighbours": [[key, similarity], ...]}`, or `{"error": KIND, "message": ...}` with exit code 1, KIND one of
`invalid` (a wrong table or word: the message says which), `unsafe` (the checkpoint holds what a checkpoint
never does), `denied` (a file of it leads where this process may not open), `unreadable` (anything else: its
type only, as an error's message may quote the bytes it could not read).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from typing import IO, Any

from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from kembed_trainer import dcp_read, export

__all__ = ["main"]


def _line(out: IO[bytes], **fields: Any) -> None:
    out.write(json.dumps(fields, ensure_ascii=False).encode() + b"\n")
    out.flush()


def _failure(error: BaseException) -> tuple[str, str]:
    if isinstance(error, CheckpointException):  # DCP wraps what failed inside a load
        error = next((e for e, _ in error.failures.values()), error)
    if isinstance(error, export.ExportError):
        return "invalid", str(error)
    if isinstance(error, dcp_read.UnsafeCheckpoint):
        return "unsafe", str(error)
    if isinstance(error, PermissionError):
        return "denied", "a file of it leads outside the checkpoint's folders"
    return "unreadable", type(error).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kembed_trainer.export_worker")
    parser.add_argument("step_uri")
    parser.add_argument("--table")
    wanted = parser.add_mutually_exclusive_group(required=True)
    wanted.add_argument("--format", choices=export.FORMATS)
    wanted.add_argument("--neighbours", metavar="WORD")
    parser.add_argument("-k", type=int, default=10)
    args = parser.parse_args(argv)
    out = sys.stdout.buffer
    try:
        with export.read_table(args.step_uri, args.table) as rows:
            if args.neighbours is not None:
                _line(out, table=rows.name, neighbours=export.neighbours(rows, args.neighbours, args.k))
                return 0
            staged = tempfile.TemporaryFile()  # noqa: SIM115 - written whole first: a failure is still an error line
            export.write(rows, args.format, staged)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - every failure is one error line
        kind, message = _failure(error)
        _line(out, error=kind, message=message)
        return 1
    with staged:
        _line(out, table=rows.name, num_bytes=staged.tell())
        staged.seek(0)
        shutil.copyfileobj(staged, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
