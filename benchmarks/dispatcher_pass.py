"""A dispatcher pass over a long queue that cannot move: the whole queue read at once, against a page at a time.

    .venv/bin/python benchmarks/dispatcher_pass.py [--queued 10000] [--passes 20]

One tenant whose one running job fills its quota (max_running_jobs 1) has `--queued` jobs waiting, so a pass
admits nothing: what it costs is reading the queue. "whole queue" is the dispatcher with one page as long as
the queue (as every pass read it before pages); "pages" is the default. The backend is the tests' fake (no
trainers), on SQLite and on a PostgreSQL server started here; prints ms of wall and of this process's CPU per
pass, and the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kembed_api.jobs import submissions  # noqa: E402
from kembed_api.platform.db import Database, upgrade_to_head  # noqa: E402
from kembed_api.platform.storage import PlatformStorage  # noqa: E402
from kembed_api.scheduling.dispatcher import Dispatcher  # noqa: E402
from kembed_api.tenants.service import ensure_tenant  # noqa: E402
from kembed_contract.spec import JobSpec  # noqa: E402
from tests.api.conftest import FakeBackend  # noqa: E402
from tests.builders import make_spec  # noqa: E402
from tests.fixtures.servers import run_postgres  # noqa: E402


def fill(db: Database, queued: int) -> None:
    with db.session(write=True) as session:
        ensure_tenant(session, name="default").quota_max_running_jobs = 1
    for batch in range(0, queued, 250):
        # A name per batch: job ids are the name and 5 random characters, and clash now and then across thousands.
        spec = JobSpec.model_validate(make_spec(f"queued-{batch}").build())
        with db.session(write=True) as session:
            tenant = ensure_tenant(session, name="default")
            submissions.submit_many(session, [submissions.Submission(tenant.id, spec)] * min(250, queued - batch),
                                storage=PlatformStorage(checkpoint_root="file:///checkpoints"))


def per_pass(db: Database, *, queue_page: int, passes: int) -> tuple[float, float]:
    """(wall ms, CPU ms) of one pass."""
    dispatcher = Dispatcher(db=db, backend=FakeBackend(slots=10**6), public_url="http://127.0.0.1:1",
                            queue_page=queue_page)
    dispatcher.run_once()  # admits the one job the quota allows; every later pass admits nothing
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(passes):
        dispatcher.run_once()
    return (time.perf_counter() - wall) / passes * 1000, (time.process_time() - cpu) / passes * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--passes", type=int, default=20)
    args = parser.parse_args()
    print(f"a pass over {args.queued:,} queued jobs that cannot move        wall ms   CPU ms")
    for database in ("SQLite", "PostgreSQL"):
        with contextlib.ExitStack() as stack:
            if database == "SQLite":
                url = f"sqlite:///{stack.enter_context(tempfile.TemporaryDirectory())}/kembed.db"
            else:
                url = stack.enter_context(run_postgres()).new_database()
            upgrade_to_head(url)
            db = Database(url)
            stack.callback(db.dispose)
            fill(db, args.queued)
            whole = per_pass(db, queue_page=args.queued + 1, passes=args.passes)
            paged = per_pass(db, queue_page=Dispatcher.__init__.__kwdefaults__["queue_page"], passes=args.passes)
            for label, (wall, cpu) in (("whole queue", whole), ("pages", paged)):
                print(f"  {database:<11} {label:<44} {wall:>7.1f}  {cpu:>7.1f}")
            print(f"  {database:<11} ratio whole queue / pages: wall {whole[0] / paged[0]:.1f}x, "
                  f"CPU {whole[1] / paged[1]:.1f}x")


if __name__ == "__main__":
    main()
