"""The local backend's trainer logs: bounded on disk, read from the end or streamed, never whole into memory.

A node's output comes through a pipe that a small process of the server's (`python -m
kembed_api.backends.node_logs`, a `LogPump`) copies into `node-<i>.log`: a process, not a thread, so that the
node's output still has somewhere to go when the server is killed, and its trainers run on until the next server
reclaims them (SIGTERM: they checkpoint and say so in their log). Once
that file holds half the node's budget it becomes `node-<i>.log.1` (the one before it is deleted, and the bytes
it held are counted in `node-<i>.log.dropped`) and a new file starts: at most the budget per node on disk, and
always the newest half of it at least. Copying costs a process per node and a write per read of the pipe
(docs/security.md#logs has the figure). Readers put a line saying what was dropped first. The trainer cannot get
around it: it never holds the file, only its end of the pipe.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["LogPump", "node_log", "pump_command", "read_tail", "stream"]

_CHUNK = 64 * 1024


def node_log(log_dir: Path, node_rank: int) -> Path:
    return log_dir / f"node-{node_rank}.log"


def _older(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def _dropped_file(path: Path) -> Path:
    return path.with_name(path.name + ".dropped")


def _dropped(path: Path) -> int:
    try:
        return int(_dropped_file(path).read_text())
    except (OSError, ValueError):
        return 0


class LogPump:
    """Copies a node's output (the read end of its pipe) into its log, keeping at most `max_bytes` on disk."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path, self.segment_bytes = path, max(1, max_bytes // 2)
        self._file = open(path, "ab")  # noqa: SIM115 (open while the node runs)
        self._size = self._file.tell()

    def write(self, data: bytes) -> None:
        if len(data) > self.segment_bytes:  # a budget smaller than one read of the pipe: keep its end
            self._add_dropped(len(data) - self.segment_bytes)
            data = data[-self.segment_bytes:]
        if self._size and self._size + len(data) > self.segment_bytes:
            self._rotate()
        self._file.write(data)
        self._file.flush()  # readers (tail, the job's failure message) see it at once
        self._size += len(data)

    def _add_dropped(self, num_bytes: int) -> None:
        _dropped_file(self.path).write_text(str(_dropped(self.path) + num_bytes))

    def _rotate(self) -> None:
        older = _older(self.path)
        with contextlib.suppress(FileNotFoundError):
            self._add_dropped(older.stat().st_size)
        self._file.close()
        os.replace(self.path, older)
        self._file = open(self.path, "ab")  # noqa: SIM115
        self._size = 0

    def close(self) -> None:
        self._file.close()


def pump_command(path: Path, max_bytes: int) -> list[str]:
    """The process that copies its stdin (a node's output) into `path`, keeping at most `max_bytes`."""
    return [sys.executable, "-m", "kembed_api.backends.node_logs", str(path), str(max_bytes)]


def main(argv: Sequence[str] | None = None) -> int:
    path, max_bytes = sys.argv[1:] if argv is None else argv
    pump = LogPump(Path(path), int(max_bytes))
    try:
        while chunk := os.read(0, _CHUNK):  # until every holder of the pipe's other end is gone
            pump.write(chunk)
    finally:
        pump.close()
    return 0


def _marker(path: Path) -> bytes:
    dropped = _dropped(path)
    if not dropped:
        return b""
    return (f"[kembed: {dropped} bytes of {path.stem}'s earliest output were dropped: a node keeps its newest "
            "output, up to KEMBED_TRAINER_LOG_BYTES_PER_NODE]\n").encode()


def _open_segments(path: Path) -> list:
    """The node's files, oldest first, opened newest first: a rotation between the two opens repeats a part
    rather than losing one."""
    files = []
    for segment in (path, _older(path)):
        with contextlib.suppress(FileNotFoundError):
            files.append(open(segment, "rb"))  # noqa: SIM115 (closed by the caller)
    return files[::-1]


def stream(path: Path) -> Iterator[bytes]:
    """A node's whole log (what is kept of it), in chunks."""
    files = _open_segments(path)
    try:
        if marker := _marker(path):
            yield marker
        for f in files:
            while chunk := f.read(_CHUNK):
                yield chunk
    finally:
        for f in files:
            f.close()


def _tail_of(f, num_lines: int) -> tuple[bytes, int]:
    """The last `num_lines` lines of file `f` (read backwards in chunks), and how many lines that is."""
    data, position = b"", f.seek(0, os.SEEK_END)
    # One newline more than the lines wanted: the line before them is cut off where the reading started.
    while position > 0 and data.count(b"\n") <= num_lines:
        step = min(_CHUNK, position)
        position -= step
        f.seek(position)
        data = f.read(step) + data
    kept = data.splitlines(keepends=True)[-num_lines:]
    return b"".join(kept), len(kept)


def read_tail(path: Path, num_lines: int) -> bytes:
    """A node's last `num_lines` lines, read from the end of its files."""
    parts: list[bytes] = []
    wanted = num_lines
    files = _open_segments(path)
    try:
        for f in reversed(files):
            if wanted <= 0:
                break
            data, found = _tail_of(f, wanted)
            parts.insert(0, data)
            wanted -= found
    finally:
        for f in files:
            f.close()
    if wanted > 0 and (marker := _marker(path)):
        parts.insert(0, marker)
    return b"".join(parts)


if __name__ == "__main__":
    sys.exit(main())
