"""`kembed status` shows what the latest eval said of a job's dynamic tables, on a line of its own."""

from __future__ import annotations

from kembed_api.cli import jobs


def test_status_shows_the_dynamic_tables_of_the_latest_eval():
    metrics = {"loss": 0.5, "eval_auc": 0.71, "eval_dynamic_rows_in_use": 12345, "eval_dynamic_admitted": 310,
               "eval_dynamic_evicted_capacity": 249, "eval_dynamic_evicted_ttl": 60}
    assert jobs.dynamic_tables_line(metrics) == (
        "dynamic    rows in use 12,345; since the eval before: admitted 310, evicted (full) 249, "
        "evicted (time to live) 60")
    assert jobs.dynamic_tables_line({"loss": 0.5, "eval_auc": 0.71}) is None  # a job without dynamic tables
    assert jobs.dynamic_tables_line({**metrics, "eval_dynamic_admitted": "310"}) is None  # a trainer's odd record
