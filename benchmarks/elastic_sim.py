"""Elastic jobs against rigid gangs over the same simulated week, through kembed's own admission core.

    .venv/bin/python benchmarks/elastic_sim.py [--jobs 2000] [--gpus 64] [--days 7] [--seed 7]
        [--elastic-share 0.5] [--efficiency 1.0 0.8] [--resize-s 90] [--size-factor 1]

The trace is benchmarks/preemption_sim.py's (5 teams in one cohort, nominal quotas adding up to the cluster,
bursty arrivals, 1-8 GPUs, 20 min to 12 h, 10 % high priority); a share of its jobs is elastic: a job that asks
for g GPUs accepts any size from ceil(g/2) to 2g (a node is one GPU here). `--size-factor k` makes every job k
times larger (big gangs, which wait longest for their whole size; fewer `--jobs` keep the load). Every policy
replays it through kembed_api.quota.preemption.decide with a simulated clock, borrowing and checkpoint-aware
preemption on:

- gang:         every job runs at its g GPUs (what kembed does today: the preemption sim's `checkpoint`);
- elastic (e):  elastic jobs start at the largest size that fits, grow into what the queue leaves (and give it
                back when a waiting job needs it), shrink instead of being preempted; `e` is the parallel
                efficiency: at n nodes a job of size g progresses (n/g)**e times as fast as at g (1.0: work
                scales linearly with nodes; 0.8: sub-linearly, a smaller size uses each GPU better).

Costs, the same in every policy: a start costs RESTART_S, a resume RESTART_S + LOAD_S (it loads its
checkpoint); a preemption SAVE_S (the victim saves on SIGTERM, then its share is free); a resize SAVE_S +
RESTART_S + LOAD_S (`--resize-s` sets their sum) without training; a growing job holds its new size at once, a
shrinking one its old size until its save is written. docs/benchmarks.md says where the figures come from.

Printed per policy: GPU utilisation over the week (held) and the part of it spent training (useful), job
completion time from submission to the end (mean, p95) and its gain on the gang's mean, preemptions, resizes
and resizes per job-hour run. No work is lost in any policy: every stop and resize saves at a step boundary.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import statistics
import sys
from dataclasses import dataclass, field

import preemption_sim

from kembed_api.quota.admission import Demand, Quota
from kembed_api.quota.preemption import Elastic, Pending, Running, Share, decide

NOMINAL = preemption_sim.NOMINAL
SAVE_S = preemption_sim.SAVE_S  # a SIGTERM save of a large model to S3
RESTART_S = 30.0  # pods scheduled and started on nodes that have the image
LOAD_S = 30.0  # a resume reads what a save wrote


@dataclass
class Job:
    seq: int
    team: str
    gpus: int  # the size it asks for; its run time is given at this size
    work_s: float
    submitted: float
    priority: int
    least: int  # its size range (least == most == gpus when rigid)
    most: int
    nodes: int = 0  # its size while it holds resources
    done_s: float = 0.0  # work done, in seconds at its asked size
    saved_s: float = 0.0  # work covered by its latest complete checkpoint
    working_from: float | None = None  # trains from then on (a start or resize pays its cost first)
    settled_at: float = 0.0  # when done_s was last brought up to date
    stopping_until: float | None = None
    shrinking_to: int | None = None
    sized_at: float | None = None  # its last start or resize
    base_nodes: int = 0  # its size at admission or its last shrink: what it grew by beyond it is lent
    preempted_at: list[float] = field(default_factory=list)
    epoch: int = 0  # bumped at every change: events of an earlier epoch are stale
    resizes: int = 0
    run_s: float = 0.0  # time holding resources
    finished: float | None = None

    @property
    def elastic(self) -> bool:
        return self.least < self.most


def with_ranges(jobs: list[preemption_sim.Job], share: float, seed: int) -> list[Job]:
    """The trace's jobs, a share of them elastic (from ceil(g/2) to 2g GPUs), chosen by their own seed so that
    the trace itself is unchanged."""
    rng = random.Random(seed + 1)
    out = []
    for j in jobs:
        elastic = rng.random() < share
        least, most = (math.ceil(j.gpus / 2), 2 * j.gpus) if elastic else (j.gpus, j.gpus)
        out.append(Job(j.seq, j.team, j.gpus, j.work_s, j.submitted, j.priority, least, most))
    return out


@dataclass
class Result:
    policy: str
    held_gpu_s: float = 0.0
    useful_gpu_s: float = 0.0
    preemptions: int = 0
    resizes: int = 0
    run_h: float = 0.0
    completion_s: list[float] = field(default_factory=list)


class Simulation:
    """One policy's week: events on a simulated clock, an admission pass after each, its plan carried out."""

    def __init__(self, jobs: list[Job], *, gpus: int, horizon: float, elastic: bool, efficiency: float,
                 resize_s: float, label: str) -> None:
        self.jobs = {j.seq: Job(j.seq, j.team, j.gpus, j.work_s, j.submitted, j.priority,
                                j.least if elastic else j.gpus, j.most if elastic else j.gpus) for j in jobs}
        self.shares = {team: Share(nominal=Quota(gpus=n), cohort="all") for team, n in NOMINAL.items()}
        self.capacity, self.horizon, self.efficiency = Quota(gpus=gpus), horizon, efficiency
        self.resize_s = resize_s
        self.result = Result(label)
        self.events: list[tuple[float, int, str, int, int]] = []  # (time, tie-breaker, kind, seq, epoch)
        self.tiebreak = itertools.count()
        self.queued: dict[int, Job] = {}
        self.active: dict[int, Job] = {}
        self.now = self.last = 0.0

    # --------------------------------------------------------------------------------------------- the clock
    def run(self) -> Result:
        for job in self.jobs.values():
            self.at(job.submitted, "arrive", job)
        while self.events:
            self.now, _, kind, seq, epoch = heapq.heappop(self.events)
            self.account(self.now)
            job = self.jobs[seq]
            if epoch != job.epoch:
                continue
            getattr(self, f"on_{kind}")(job)
            self.admission_pass()
        self.account(self.horizon)
        for job in self.jobs.values():
            self.result.completion_s.append(job.finished - job.submitted)
            self.result.run_h += job.run_s / 3600
        return self.result

    def at(self, when: float, kind: str, job: Job) -> None:
        heapq.heappush(self.events, (when, next(self.tiebreak), kind, job.seq, job.epoch))

    def account(self, until: float) -> None:
        span = max(0.0, min(until, self.horizon) - min(self.last, self.horizon))
        self.result.held_gpu_s += span * sum(j.nodes for j in self.active.values())
        for job in self.active.values():
            job.run_s += until - self.last
        self.last = until

    # ------------------------------------------------------------------------------------------ a job's work
    def rate(self, job: Job) -> float:
        """Work done per second at its size now, in seconds at its asked size."""
        return (job.nodes / job.gpus) ** self.efficiency

    def progress(self, job: Job) -> float:
        """Its work done by now (not yet settled)."""
        if job.working_from is None:
            return job.done_s
        return min(job.work_s, job.done_s + max(0.0, self.now - max(job.settled_at, job.working_from)) * self.rate(job))

    def at_risk(self, job: Job) -> float:
        """GPU-seconds done since its latest checkpoint (a save on stop, or a periodic one every 30 min of work)."""
        done = self.progress(job)
        return job.nodes * (done - preemption_sim._checkpointed(job, done))

    def settle(self, job: Job) -> None:
        """Brings its work done up to now (and counts the GPU-seconds it trained, within the week)."""
        if job.working_from is not None:
            start = max(job.settled_at, job.working_from)
            if self.now > start:
                job.done_s = min(job.work_s, job.done_s + (self.now - start) * self.rate(job))
                trained = max(0.0, min(self.now, self.horizon) - min(start, self.horizon))
                self.result.useful_gpu_s += trained * job.nodes
        job.settled_at = self.now

    def work_from(self, job: Job, when: float | None) -> None:
        """It trains from `when` (None: it does not); its end is scheduled accordingly."""
        job.epoch += 1
        job.working_from = when
        if when is not None:
            self.at(when + (job.work_s - job.done_s) / self.rate(job), "finish", job)

    def checkpoint(self, job: Job) -> None:
        """It saves at a step boundary (the trainer finishes the step every rank is on, then saves): everything
        done so far is kept."""
        self.settle(job)
        job.saved_s = job.done_s

    # ----------------------------------------------------------------------------------------------- events
    def on_arrive(self, job: Job) -> None:
        self.queued[job.seq] = job

    def on_finish(self, job: Job) -> None:
        self.settle(job)
        del self.active[job.seq]
        job.finished, job.nodes, job.working_from = self.now, 0, None

    def on_stopped(self, job: Job) -> None:
        del self.active[job.seq]
        job.stopping_until, job.nodes = None, 0
        self.queued[job.seq] = job  # back in the queue at its old place

    def on_shrunk(self, job: Job) -> None:
        """Its save is written: it gives back what it no longer needs and restarts smaller."""
        job.nodes, job.shrinking_to, job.sized_at = job.shrinking_to, None, self.now
        job.settled_at = self.now
        self.work_from(job, self.now + self.resize_s - SAVE_S)

    # ----------------------------------------------------------------------------------------- the decision
    def admission_pass(self) -> None:
        now = self.now
        running = [
            Running(j.seq, j.team, Demand(gpus=j.nodes, running_jobs=1), j.priority,
                    work_at_risk=self.at_risk(j), stopping=j.stopping_until is not None,
                    protected=sum(1 for t in j.preempted_at if now - t < preemption_sim.PROTECT_WINDOW_S)
                    >= preemption_sim.PROTECT_AFTER,
                    elastic=Elastic(j.nodes, j.least, j.most) if j.elastic else None,
                    shrinking_to=j.shrinking_to, resized_at=j.sized_at, base_nodes=j.base_nodes)
            for j in self.active.values()
        ]
        queue = [Pending(j.seq, j.team, Demand(gpus=j.most, running_jobs=1), j.priority,
                         elastic=Elastic(j.most, j.least, j.most) if j.elastic else None)
                 for j in sorted(self.queued.values(), key=lambda j: (-j.priority, j.seq))]
        plan = decide(shares=self.shares, capacity=self.capacity, running=running, queue=queue, now=now)
        for admit in plan.admit:
            job = self.queued.pop(admit.key)
            self.active[job.seq] = job
            job.nodes = job.base_nodes = admit.nodes or job.gpus
            job.sized_at, job.settled_at = now, now
            self.work_from(job, now + RESTART_S + (LOAD_S if job.done_s else 0.0))
        for preempt in plan.preempt:
            job = self.active[preempt.victim]
            self.result.preemptions += 1
            job.preempted_at.append(now)
            self.checkpoint(job)
            job.stopping_until = now + SAVE_S
            self.work_from(job, None)
            self.at(job.stopping_until, "stopped", job)
        for resize in plan.resize:
            job = self.active[resize.key]
            self.result.resizes += 1
            self.checkpoint(job)
            if resize.nodes > job.nodes:  # it holds the larger size at once and trains after its resize
                job.nodes, job.sized_at = resize.nodes, now
                self.work_from(job, now + self.resize_s)
            else:  # it holds its size until its save is written
                job.shrinking_to = resize.nodes
                job.base_nodes = min(job.base_nodes, resize.nodes)
                self.work_from(job, None)
                self.at(now + SAVE_S, "shrunk", job)


def _p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--elastic-share", type=float, default=0.5, help="share of jobs given a size range")
    parser.add_argument("--efficiency", type=float, nargs="+", default=[1.0, 0.8],
                        help="parallel efficiency of each elastic run (1.0: linear)")
    parser.add_argument("--resize-s", type=float, default=SAVE_S + RESTART_S + LOAD_S,
                        help="seconds a resize costs: save, restart and load")
    parser.add_argument("--size-factor", type=int, default=1, help="every job this many times larger")
    args = parser.parse_args(argv)
    horizon = args.days * 86400
    trace = preemption_sim.trace(args.jobs, args.days, args.seed)
    for job in trace:
        job.gpus *= args.size_factor
    jobs = with_ranges(trace, args.elastic_share, args.seed)
    offered = sum(j.gpus * j.work_s for j in jobs) / (args.gpus * horizon)
    print(f"{len(jobs)} jobs ({sum(j.elastic for j in jobs)} elastic), {args.gpus} GPUs, {args.days:g} days; "
          f"offered load {offered:.0%} of the cluster; a resize costs {args.resize_s:g} s; work lost: none")
    runs = [("gang", False, 1.0)] + [(f"elastic ({e:g})", True, e) for e in args.efficiency]
    results = [Simulation(jobs, gpus=args.gpus, horizon=horizon, elastic=elastic, efficiency=e,
                          resize_s=args.resize_s, label=label).run() for label, elastic, e in runs]
    capacity_s = args.gpus * horizon
    print(f"\n{'policy':<15} {'util':>6} {'useful':>7} {'JCT mean h':>11} {'p95 h':>7} {'vs gang':>8} "
          f"{'preempt':>8} {'resizes':>8} {'per job-h':>10}")
    gang_mean = statistics.fmean(results[0].completion_s)
    for r in results:
        mean = statistics.fmean(r.completion_s)
        print(f"{r.policy:<15} {r.held_gpu_s / capacity_s:>6.1%} {r.useful_gpu_s / capacity_s:>7.1%} "
              f"{mean / 3600:>11.1f} {_p95(r.completion_s) / 3600:>7.1f} {1 - mean / gang_mean:>+8.1%} "
              f"{r.preemptions:>8} {r.resizes:>8} {r.resizes / r.run_h:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
