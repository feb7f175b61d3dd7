"""`kembed serve --workers N`: N HTTP worker processes on one port, each a whole kembed app.

Each worker listens on a socket of its own bound with SO_REUSEPORT, so the kernel spreads new connections over
the workers evenly (by a hash of each connection's addresses). With one socket shared by all workers (uvicorn's
own `workers=`), whichever worker woke first accepted a whole burst of connections: keep-alive clients that
connect together, a load balancer's pool, all landed on one worker while the others idled.

One worker at a time runs the dispatcher (a lock in the data dir chooses it, kembed_api.scheduling.dispatcher); all of
them serve requests. This process only supervises: a worker that dies is started again, and SIGTERM or SIGINT
stops the workers gracefully (each lets its trainers checkpoint, as a single server does) before it returns.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import threading
import time
from collections import deque
from typing import Any

from kembed_api.platform.settings import Settings

__all__ = ["serve_workers"]

log = logging.getLogger(__name__)
_CHECK_S = 0.5  # how often the supervisor looks for a dead worker
# Workers that keep dying (a port taken, a database unreachable) would die again however often they are started:
# this many deaths within the window stop the server, saying so.
_DEATHS, _DEATHS_WINDOW_S = 5, 60.0


class WorkersKeepDying(RuntimeError):
    pass


def serve_workers(settings: Settings, overrides: dict[str, Any]) -> None:
    """Serve with `settings.workers` processes until SIGTERM or SIGINT; `overrides` are the command's options.
    Raises WorkersKeepDying when they do (their errors are in the log before)."""
    _prepare(settings, overrides)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of this one's state is shared
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())

    def start() -> multiprocessing.Process:
        process = context.Process(target=_worker, args=(settings.host, settings.port), name="kembed-worker")
        process.start()
        return process

    workers = [start() for _ in range(settings.workers)]
    deaths: deque[float] = deque(maxlen=_DEATHS)
    while not stopping.wait(_CHECK_S):
        for i, process in enumerate(workers):
            if process.is_alive():
                continue
            deaths.append(time.monotonic())
            if len(deaths) == _DEATHS and deaths[-1] - deaths[0] < _DEATHS_WINDOW_S:
                _stop(workers)
                raise WorkersKeepDying(f"{_DEATHS} workers ended within {_DEATHS_WINDOW_S:g} s, the last with "
                                       f"{process.exitcode}; see the errors above")
            log.warning("worker %s ended with %s; starting another", process.pid, process.exitcode)
            workers[i] = start()
    _stop(workers)


def _stop(workers: list[multiprocessing.Process]) -> None:
    for process in workers:
        if process.is_alive():
            # (After Ctrl-C the workers have their SIGINT already; uvicorn takes a SIGTERM after it as the same
            # graceful stop, not as a second Ctrl-C's forced one.)
            os.kill(process.pid, signal.SIGTERM)
    for process in workers:
        process.join()


def _prepare(settings: Settings, overrides: dict[str, Any]) -> None:
    """What the workers need before they start. Each builds its app from the environment, so the command's options
    travel as KEMBED_ variables; the schema is migrated once here rather than raced to by every worker; and
    metrics observed in one worker (admission waits, by the one that dispatches) are shared through
    prometheus_client's multiprocess files, so that any worker answers a scrape whole."""
    from kembed_api.platform.db import upgrade_to_head

    given = {**overrides, "data_dir": settings.data_dir, "workers": settings.workers}
    os.environ.update({f"KEMBED_{key.upper()}": str(value) for key, value in given.items()})
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(settings.resolved_database_url)
    metrics_dir = settings.data_dir / "worker-metrics"
    shutil.rmtree(metrics_dir, ignore_errors=True)  # a previous run's values are not this one's
    metrics_dir.mkdir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)


def _worker(host: str, port: int) -> None:
    import uvicorn

    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind(address)
    config = uvicorn.Config("kembed_api.app:create_app", factory=True, log_level="warning")
    uvicorn.Server(config).run(sockets=[listener])
