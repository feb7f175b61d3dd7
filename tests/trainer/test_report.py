"""The reporter's delivery: every record reaches the API once acknowledged, in order, across refusals to answer
and a restart of the API on the same port; what the API refuses for good is dropped, and nothing waits forever.

The API's report route is played by a small HTTP server here (the real one is exercised with real trainers in
tests/security/test_reports.py); what is tested is the reporter's side of the exchange.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kembed_api.platform.ports import free_port
from kembed_contract import runtime
from kembed_trainer import report


class _Api:
    """Answers each POST with the next status of `statuses` (then 204; 422 for a body holding a record `refuse`
    picks), keeping the records it acknowledged and counting the POSTs."""

    def __init__(self, port: int, statuses: list[int] | None = None,
                 refuse: Callable[[dict], bool] = lambda record: False) -> None:
        self.received: list[dict] = []
        self.posts = 0
        self.statuses = list(statuses or [])
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                records = body if isinstance(body, list) else [body]  # one record, or several in order
                api.posts += 1
                status = api.statuses.pop(0) if api.statuses else 422 if any(map(refuse, records)) else 204
                if status == 204:
                    api.received.extend(records)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _reporter(port: int, **kwargs) -> report.Reporter:
    return report.Reporter(enabled=True, url=f"http://127.0.0.1:{port}/v1/jobs/j/reports", token="t",
                           out=io.StringIO(), **kwargs)


def test_records_survive_refusals_and_an_api_restart_in_order_and_close_waits_for_them():
    port = free_port()
    api = _Api(port, statuses=[503, 502])
    reporter = _reporter(port, max_backoff_s=0.5)
    reporter.emit("started", 0)
    api.stop()  # the API restarts: nothing listens for a while
    reporter.emit("checkpoint", 60, uri="file:///c/step-60")
    reporter.emit("done", 60, eval={"auc": 0.7})
    restarted: list[_Api] = []
    timer = threading.Timer(1.5, lambda: restarted.append(_Api(port)))  # back, on the same port
    timer.start()
    reporter.close()  # returns only once everything was acknowledged
    timer.join()
    again = restarted[0]
    try:
        delivered = api.received + again.received
        assert [(r["event"], r["seq"]) for r in delivered] == [("started", 1), ("checkpoint", 2), ("done", 3)]
        assert reporter.undelivered == 0
    finally:
        again.stop()


def test_a_record_refused_for_good_is_dropped_and_the_next_ones_still_go():
    port = free_port()
    api = _Api(port, refuse=lambda record: record["event"] == "progress" and record["step"] == 1)
    reporter = _reporter(port)
    reporter.emit("progress", 1, loss=1.0)  # with the others in one POST or alone: only it is refused
    reporter.emit("progress", 2, loss=0.5)
    reporter.emit("done", 2)
    reporter.close()
    api.stop()
    assert [(r["event"], r["step"]) for r in api.received] == [("progress", 2), ("done", 2)]
    assert reporter.undelivered == 1


def test_records_queued_behind_one_another_go_together_in_order():
    """A fast job's records are not held to the API's limit on a job's POSTs (KEMBED_RATE_REPORT_PER_S): those
    queued while one POST is under way go in the next, at most MAX_RECORDS_PER_REPORT to a POST."""
    port = free_port()
    reporter = _reporter(port, max_backoff_s=0.2)
    for step in range(1, 251):  # nothing listens yet: they queue
        reporter.emit("progress", step, loss=1.0 / step)
    time.sleep(0.5)
    api = _Api(port)
    reporter.close()
    api.stop()
    assert [r["step"] for r in api.received] == list(range(1, 251))
    assert api.posts <= 1 + -(-249 // runtime.MAX_RECORDS_PER_REPORT), api.posts


def test_a_job_that_is_gone_ends_delivery():
    port = free_port()
    api = _Api(port, statuses=[404] * 10)
    reporter = _reporter(port)
    for step in range(3):
        reporter.emit("progress", step)
    reporter.close()
    api.stop()
    assert api.received == [] and reporter.undelivered == 3


def test_an_api_that_never_comes_back_holds_the_exit_no_longer_than_the_flush_and_backs_off_boundedly():
    pauses: list[float] = []
    reporter = _reporter(free_port(), flush_s=3.0, max_backoff_s=0.8, sleep=lambda s: (pauses.append(s),
                                                                                        threading.Event().wait(s)))
    reporter.emit("done", 5)
    reporter.close()
    assert reporter.undelivered == 1
    assert pauses and max(pauses) == 0.8 and pauses[:3] == [0.2, 0.4, 0.8]
