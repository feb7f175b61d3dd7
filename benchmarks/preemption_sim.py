"""A week of 2,000 jobs from 5 teams on 64 GPUs, through kembed's own admission core with a simulated clock.

    .venv/bin/python benchmarks/preemption_sim.py [--jobs 2000] [--gpus 64] [--days 7] [--seed 7]

The teams' nominal quotas add up to the cluster (20/16/12/8/8 GPUs). Each team works in bursts (busy for a
while, then quiet), at different times, so one team's quota sits idle while another's queue is long. Every
policy replays the same trace through kembed_api.quota.preemption.decide, the function the dispatcher calls:

- rigid:       every team has its nominal quota and no more (no cohort, no preemption);
- checkpoint:  one cohort (idle quota is lent; the lender reclaims it by preemption; high-priority jobs
               preempt lower ones), victims save on SIGTERM within the grace period and resume from there;
- kill:        the same borrowing and preemption, but victims are killed and resume from their last periodic
               checkpoint (what Kueue, Volcano and KubeRay do today).

Trainers checkpoint every 30 minutes of their own run time in every policy; a SIGTERM save takes 30 s (the
grace period is 120 s). A job preempted 3 times within 24 h is protected from further preemption.

Printed per policy: GPU utilisation over the week (GPU-seconds held / (GPUs x week)), useful utilisation (held
minus time spent saving and work thrown away), each team's wait from submission to first start (mean, p90),
the longest time any team waited with a job its guarantee covers (the head of its queue fitting within its
nominal quota), preemptions, and GPU-hours of work lost (done, then thrown away).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for folder in ("contract", "api", "trainer_image"):
    sys.path.insert(0, str(REPO / folder))

from kembed_api.quota.admission import Demand, Quota  # noqa: E402
from kembed_api.quota.preemption import Pending, Running, Share, decide  # noqa: E402

NOMINAL = {"ads": 20, "search": 16, "feeds": 12, "maps": 8, "music": 8}
CHECKPOINT_EVERY_S = 1800.0
SAVE_S = 30.0  # a SIGTERM save, well within the grace period
GRACE_S = 120.0
PROTECT_AFTER, PROTECT_WINDOW_S = 3, 24 * 3600.0
HIGH, NORMAL = 1000, 0


@dataclass
class Job:
    seq: int
    team: str
    gpus: int
    work_s: float  # run time it needs
    submitted: float
    priority: int
    done_s: float = 0.0  # work done and kept (checkpointed or running)
    saved_s: float = 0.0  # work covered by its latest complete checkpoint
    started: float | None = None  # first start
    run_since: float | None = None  # current run
    stopping_until: float | None = None
    preempted_at: list[float] = field(default_factory=list)
    finished: float | None = None


def trace(num_jobs: int, days: float, seed: int) -> list[Job]:
    """Bursty demand: each team is busy about a third of the time, in bursts of half a day to two days, at its
    own times; inside a burst its jobs arrive as a Poisson stream. Sizes 1-8 GPUs, run times 20 min to 12 h
    (log-normal). The load offered over the week is a little above the cluster's capacity."""
    rng = random.Random(seed)
    horizon = days * 86400
    bursts: dict[str, list[tuple[float, float]]] = {}
    for team in NOMINAL:
        spans, t = [], rng.uniform(0, 86400)
        while t < horizon:
            length = rng.uniform(0.5, 2.0) * 86400
            spans.append((t, min(horizon, t + length)))
            t += length + rng.uniform(1.0, 3.0) * 86400
        bursts[team] = spans
    weights = {team: NOMINAL[team] * sum(e - s for s, e in bursts[team]) for team in NOMINAL}
    jobs: list[Job] = []
    for team in NOMINAL:
        count = round(num_jobs * weights[team] / sum(weights.values()))
        busy = sum(e - s for s, e in bursts[team])
        for _ in range(count):
            offset = rng.uniform(0, busy)
            for start, end in bursts[team]:
                if offset < end - start:
                    submitted = start + offset
                    break
                offset -= end - start
            gpus = rng.choice([1, 1, 2, 2, 4, 4, 8])
            work = min(12 * 3600.0, max(1200.0, rng.lognormvariate(8.6, 0.9)))
            priority = HIGH if rng.random() < 0.1 else NORMAL
            jobs.append(Job(0, team, gpus, work, submitted, priority))
    jobs.sort(key=lambda j: j.submitted)
    for seq, job in enumerate(jobs[:num_jobs], 1):
        job.seq = seq
    return jobs[:num_jobs]


@dataclass
class Result:
    policy: str
    held_gpu_s: float = 0.0
    saving_gpu_s: float = 0.0
    lost_gpu_s: float = 0.0
    preemptions: int = 0
    waits: dict[str, list[float]] = field(default_factory=dict)
    longest_guaranteed_wait: dict[str, float] = field(default_factory=dict)
    unfinished: int = 0


def simulate(jobs: list[Job], *, gpus: int, horizon: float, policy: str) -> Result:
    jobs = [Job(j.seq, j.team, j.gpus, j.work_s, j.submitted, j.priority) for j in jobs]
    cohort = None if policy == "rigid" else "all"
    shares = {team: Share(nominal=Quota(gpus=n), cohort=cohort) for team, n in NOMINAL.items()}
    capacity = Quota(gpus=gpus)
    result = Result(policy, waits={t: [] for t in NOMINAL}, longest_guaranteed_wait={t: 0.0 for t in NOMINAL})
    events: list[tuple[float, int, str, int]] = []  # (time, tie-breaker, kind, seq)
    tiebreak = itertools.count()
    by_seq = {j.seq: j for j in jobs}
    for job in jobs:
        heapq.heappush(events, (job.submitted, next(tiebreak), "arrive", job.seq))
    queued: dict[int, Job] = {}
    active: dict[int, Job] = {}  # running or stopping
    waiting_since: dict[str, float | None] = {t: None for t in NOMINAL}  # head within guarantee waits since
    now, last = 0.0, 0.0

    def account(until: float) -> None:
        nonlocal last
        span = max(0.0, min(until, horizon) - min(last, horizon))
        result.held_gpu_s += span * sum(j.gpus for j in active.values())
        result.saving_gpu_s += span * sum(j.gpus for j in active.values() if j.stopping_until is not None)
        last = until

    def progress(job: Job) -> float:
        return job.done_s + (now - job.run_since if job.run_since is not None else 0.0)

    def stop(job: Job) -> None:
        """The victim's run ends now: what it keeps depends on how it was stopped."""
        job.done_s = progress(job)
        job.run_since = None

    while events:
        now, _, kind, seq = heapq.heappop(events)
        account(now)
        job = by_seq[seq]
        if kind == "arrive":
            queued[seq] = job
        elif kind == "finish":
            if seq in active and job.run_since is not None and abs(progress(job) - job.work_s) < 1e-3:
                del active[seq]
                job.finished, job.run_since = now, None
        elif kind == "stopped" and seq in active and job.stopping_until == now:
            del active[seq]
            job.stopping_until = None
            queued[seq] = job  # back in the queue at its old place (its priority and seq are unchanged)
        _admission_pass(now, shares, capacity, queued, active, events, tiebreak, result, policy, progress, stop)
        _watch_guarantees(now, shares, queued, active, waiting_since, result)
    account(horizon)
    result.unfinished = sum(1 for j in jobs if j.finished is None)
    for job in jobs:
        if job.started is not None:
            result.waits[job.team].append(job.started - job.submitted)
    return result


def _checkpointed(job: Job, done: float) -> float:
    """Work covered by its latest periodic checkpoint (every CHECKPOINT_EVERY_S of run time)."""
    return max(job.saved_s, (done // CHECKPOINT_EVERY_S) * CHECKPOINT_EVERY_S)


def _admission_pass(now, shares, capacity, queued, active, events, tiebreak, result, policy, progress, stop):
    running = [
        Running(j.seq, j.team, Demand(gpus=j.gpus, running_jobs=1), j.priority,
                work_at_risk=j.gpus * (progress(j) - _checkpointed(j, progress(j))) if j.run_since else 0.0,
                stopping=j.stopping_until is not None,
                protected=sum(1 for t in j.preempted_at if now - t < PROTECT_WINDOW_S) >= PROTECT_AFTER)
        for j in active.values()
    ]
    queue = [Pending(j.seq, j.team, Demand(gpus=j.gpus, running_jobs=1), j.priority)
             for j in sorted(queued.values(), key=lambda j: (-j.priority, j.seq))]
    plan = decide(shares=shares, capacity=capacity, running=running, queue=queue, preemption=policy != "rigid")
    for admit in plan.admit:
        job = queued.pop(admit.key)
        active[job.seq] = job
        job.started = job.started if job.started is not None else now
        job.run_since = now
        heapq.heappush(events, (now + job.work_s - job.done_s, next(tiebreak), "finish", job.seq))
    for preempt in plan.preempt:
        job = active[preempt.victim]
        result.preemptions += 1
        job.preempted_at.append(now)
        done = progress(job)
        stop(job)
        if policy == "checkpoint":  # it saves on SIGTERM: nothing lost, SAVE_S spent saving
            job.saved_s = done
            job.stopping_until = now + SAVE_S
        else:  # killed: resumes from its last periodic checkpoint
            kept = _checkpointed(job, done)
            result.lost_gpu_s += job.gpus * (done - kept)
            job.done_s = job.saved_s = kept
            job.stopping_until = now  # the pods go at once
        heapq.heappush(events, (job.stopping_until, next(tiebreak), "stopped", job.seq))


def _watch_guarantees(now, shares, queued, active, waiting_since, result):
    """How long a team's queue head waits although it fits within the team's nominal quota."""
    for team, share in shares.items():
        used = sum(j.gpus for j in active.values() if j.team == team)
        heads = sorted((j for j in queued.values() if j.team == team), key=lambda j: (-j.priority, j.seq))
        covered = bool(heads) and used + heads[0].gpus <= share.nominal.gpus
        if covered and waiting_since[team] is None:
            waiting_since[team] = now
        elif not covered and waiting_since[team] is not None:
            result.longest_guaranteed_wait[team] = max(result.longest_guaranteed_wait[team],
                                                       now - waiting_since[team])
            waiting_since[team] = None


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) >= 2 else (values[0] if values else 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    horizon = args.days * 86400
    jobs = trace(args.jobs, args.days, args.seed)
    offered = sum(j.gpus * j.work_s for j in jobs) / (args.gpus * horizon)
    print(f"{len(jobs)} jobs, {args.gpus} GPUs, {args.days:g} days; offered load {offered:.0%} of the cluster; "
          f"nominal {NOMINAL}")
    results = [simulate(jobs, gpus=args.gpus, horizon=horizon, policy=p) for p in ("rigid", "checkpoint", "kill")]
    capacity_s = args.gpus * horizon
    print(f"\n{'policy':<11} {'util':>6} {'useful':>7} {'preempt':>8} {'lost GPU-h':>11} {'saving GPU-h':>13} "
          f"{'unfinished':>10}")
    for r in results:
        useful = (r.held_gpu_s - r.saving_gpu_s - r.lost_gpu_s) / capacity_s
        print(f"{r.policy:<11} {r.held_gpu_s / capacity_s:>6.1%} {useful:>7.1%} {r.preemptions:>8} "
              f"{r.lost_gpu_s / 3600:>11.1f} {r.saving_gpu_s / 3600:>13.1f} {r.unfinished:>10}")
    print(f"\n{'wait (h): mean / p90':<22}" + "".join(f"{r.policy:>20}" for r in results))
    for team in NOMINAL:
        cells = "".join(f"{statistics.fmean(r.waits[team] or [0]) / 3600:>12.1f} / {_p90(r.waits[team]) / 3600:>5.1f}"
                        for r in results)
        print(f"{team + f' ({NOMINAL[team]} GPUs)':<22}{cells}")
    print(f"\n{'longest wait within guarantee (s)':<34}" + "".join(f"{r.policy:>12}" for r in results))
    for team in NOMINAL:
        print(f"{team:<34}" + "".join(f"{r.longest_guaranteed_wait[team]:>12.0f}" for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
