"""Where each kind's job spends its seconds, from submission to result, on the embedded default.

    .venv/bin/python benchmarks/job_seconds.py                 # each kind once, one after the other
    .venv/bin/python benchmarks/job_seconds.py --rounds 3 --cpu 2

Submits the jobs of benchmarks/embedded_jobs.py (the ratings defaults on MovieLens-100k, word2vec's text defaults
on gensim's Lee corpus, a small DLRM) to a fresh `kembed serve`, one at a time so that none waits for another, and
prints each job's split of its wall time by phase (kembed_contract.job_seconds: what `GET /v1/jobs/{id}` and
`kembed status` show), the median of the rounds per phase, and each job's fixed cost: what is not data, training,
evaluation or saving (queued, process start, imports, exit, other), the seconds every job pays whatever its size. `--cpu` is each job's resources.cpu_per_node (its
threads and its cores); by default the cores this process may use, as a quiet machine gives a lone job.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import embedded_jobs  # noqa: E402
from kembed_contract import job_seconds  # noqa: E402

# What a job pays whatever its size: the phases that are not its work (kembed_contract.job_seconds).
_FIXED = ("queued", "process_start", "imports", "exit", "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cpu", type=float, default=float(len(os.sched_getaffinity(0))))
    parser.add_argument("--kinds", nargs="+", default=list(embedded_jobs.KINDS), choices=embedded_jobs.KINDS)
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f}; each job cpu_per_node {args.cpu:g}, {args.rounds} round(s)")
    splits: dict[str, list[dict]] = {kind: [] for kind in args.kinds}
    with tempfile.TemporaryDirectory() as tmp, embedded_jobs.server(pathlib.Path(tmp), slots=1) as server:
        data = pathlib.Path(tmp) / "data"
        for _ in range(args.rounds):
            for kind in args.kinds:
                job = server.client.submit(embedded_jobs.spec(kind, data, cpu=args.cpu))
                done, = embedded_jobs.wait_all(server, [job["id"]])
                splits[kind].append(done["seconds"])
                print(f"  {kind}: {done['seconds']}  result {done['result']}", flush=True)
    columns = ["wall", *job_seconds.PHASES]
    print(f"\n{'kind':<8} " + " ".join(f"{job_seconds.PHASE_LABELS.get(c, c)[:12]:>12}" for c in columns))
    for kind, runs in splits.items():
        medians = {c: statistics.median(r[c] for r in runs) for c in columns}
        print(f"{kind:<8} " + " ".join(f"{medians[c]:>12.2f}" for c in columns))
        print(f"{'':<8} " + " ".join(f"{100 * medians[c] / medians['wall']:>11.0f}%" for c in columns))
    print(f"\nfixed cost (median of each job's {' + '.join(_FIXED)}):")
    for kind, runs in splits.items():
        fixed = statistics.median(sum(r[p] for p in _FIXED) for r in runs)
        print(f"  {kind:<8} {fixed:6.2f} s of {statistics.median(r['wall'] for r in runs):6.2f} s")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
