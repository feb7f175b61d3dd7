"""Elastic jobs in the admission core, pure: the size a job starts at, shrinking instead of preempting, and fair
growth into what the queue leaves (kembed_api.quota.preemption's docstring says the rules)."""

from __future__ import annotations

import dataclasses

import pytest

from kembed_api.quota.admission import Demand, Quota
from kembed_api.quota.preemption import Admit, Elastic, Pending, Resize, Running, Share, decide
from kembed_contract.spec import JobSpec
from tests.builders import make_spec

LOW, NORMAL, HIGH = 0, 100, 1000
CLUSTER = Quota(gpus=16)
LONG_AGO = -10**9  # a start or resize the cool-down has long forgotten


def gpus(n: int) -> Demand:
    """One job of `n` single-GPU nodes."""
    return Demand(gpus=n, running_jobs=1)


def share(nominal: int, *, cohort: str | None = "research", borrow: int | None = None) -> Share:
    return Share(nominal=Quota(gpus=nominal), cohort=cohort, borrowing_limit=Quota(gpus=borrow))


def elastic_running(key, tenant, nodes, least, most, *, priority=NORMAL, at_risk=0.0, resized_at=LONG_AGO,
                    protected=False) -> Running:
    return Running(key, tenant, gpus(nodes), priority, work_at_risk=at_risk, protected=protected,
                   elastic=Elastic(nodes, least, most), resized_at=resized_at)


def rigid_running(key, tenant, n, *, priority=NORMAL, at_risk=0.0) -> Running:
    return Running(key, tenant, gpus(n), priority, work_at_risk=at_risk)


def elastic_pending(key, tenant, least, most, *, priority=NORMAL) -> Pending:
    return Pending(key, tenant, gpus(most), priority, elastic=Elastic(most, least, most))


def rigid_pending(key, tenant, n, *, priority=NORMAL) -> Pending:
    return Pending(key, tenant, gpus(n), priority)


def sizes(plan) -> dict:
    """Each resized job's new size, with its reason."""
    return {r.key: (r.nodes, r.reason) for r in plan.resize}


def test_what_a_job_holds_at_another_size_is_what_the_same_spec_asks_at_that_size():
    def demand(nodes: int) -> Demand:
        spec = make_spec().with_gpus(2).with_resources(nodes=nodes, cpu_per_node=1.5, memory_per_node="3Gi")
        return Demand.of(JobSpec.model_validate(spec.spec))

    assert demand(4).resized(4, 3) == demand(3) and demand(1).resized(1, 5) == demand(5)
    assert demand(3).resized(3, 2).running_jobs == 1


def test_an_elastic_job_starts_at_the_largest_size_that_fits():
    plan = decide(shares={"a": share(16, cohort=None)}, capacity=CLUSTER, running=[rigid_running(1, "a", 10)],
                  queue=[elastic_pending(2, "a", 2, 8)])
    assert plan.admit == [Admit(2, borrowed=False, nodes=6)]


def test_an_elastic_job_borrows_its_cohorts_idle_quota_to_start_larger_once_borrowers_ahead_had_their_turn():
    shares = {"a": share(4), "b": share(12)}
    plan = decide(shares=shares, capacity=CLUSTER, running=[],
                  queue=[rigid_pending(1, "b", 4, priority=HIGH), elastic_pending(2, "a", 2, 16),
                         rigid_pending(3, "b", 12)])
    # within its quota it would start at 4; b's second job waits (it needs 12, 8 are free once a is admitted), and
    # is behind a: a borrows the rest
    assert plan.admit == [Admit(1, borrowed=False), Admit(2, borrowed=True, nodes=12)]
    ahead = decide(shares=shares, capacity=CLUSTER, running=[],
                   queue=[rigid_pending(1, "b", 4, priority=HIGH), rigid_pending(3, "b", 10, priority=HIGH),
                          elastic_pending(2, "a", 2, 16)])
    # b's second job is ahead of a and needs 10 (borrowing 2): a starts at its minimum, leaving b's job the room
    assert ahead.admit == [Admit(1, borrowed=False), Admit(2, borrowed=False, nodes=2), Admit(3, borrowed=True)]


def test_an_elastic_job_waits_when_not_even_its_minimum_fits():
    plan = decide(shares={"a": share(16, cohort=None)}, capacity=CLUSTER, running=[rigid_running(1, "a", 15)],
                  queue=[elastic_pending(2, "a", 2, 8)])
    assert plan.admit == [] and plan.wait[0].key == 2 and "quota.gpus: needs 2 GPUs" in plan.wait[0].reason


def test_an_elastic_job_leaves_a_waiting_job_ahead_of_it_what_that_job_needs():
    """b's head (8 GPUs) waits for a's job to end; c's elastic job behind it starts at its minimum, not at 6."""
    shares = {"a": share(16, cohort=None), "b": share(16, cohort=None), "c": share(16, cohort=None)}
    plan = decide(shares=shares, capacity=CLUSTER, running=[rigid_running(1, "a", 4)],
                  queue=[rigid_pending(2, "a", 8), rigid_pending(3, "b", 8, priority=NORMAL),
                         elastic_pending(4, "c", 2, 6)])
    assert plan.admit == [Admit(2, borrowed=False), Admit(4, borrowed=False, nodes=2)]
    assert [w.key for w in plan.wait] == [3]


def test_a_running_elastic_job_grows_into_capacity_freed_by_a_job_that_ended():
    plan = decide(shares={"a": share(16, cohort=None)}, capacity=CLUSTER,
                  running=[elastic_running(1, "a", 4, 2, 12), rigid_running(2, "a", 2)], queue=[])
    assert sizes(plan) == {1: (12, "IdleCapacity")}


def test_the_queue_comes_first_growth_gets_only_what_no_waiting_job_can_start_with():
    shares = {"a": share(16, cohort=None), "b": share(16, cohort=None)}
    running = [elastic_running(1, "a", 4, 2, 16), rigid_running(2, "b", 6)]
    plan = decide(shares=shares, capacity=CLUSTER, running=running,
                  queue=[rigid_pending(3, "b", 4), rigid_pending(4, "b", 4)])
    # of the 6 idle GPUs, b's first queued job takes 4; its second cannot start with the 2 left, a grows by them
    assert plan.admit == [Admit(3, borrowed=False)] and [w.key for w in plan.wait] == [4]
    assert sizes(plan) == {1: (6, "IdleCapacity")}


def test_a_waiting_job_takes_back_what_a_job_grew_by_before_anyone_is_preempted():
    shares = {"a": share(16, cohort=None)}
    grown = Running(1, "a", gpus(10), NORMAL, elastic=Elastic(10, 2, 16), resized_at=LONG_AGO, base_nodes=4)
    running = [grown, rigid_running(2, "a", 6, priority=LOW)]
    plan = decide(shares=shares, capacity=CLUSTER, running=running, queue=[rigid_pending(3, "a", 5, priority=HIGH)])
    # the high-priority job could preempt the low one; the grown job gives back 5 of its 6 lent nodes instead
    assert plan.preempt == [] and plan.resize == [Resize(1, 5, "QueueFirst", preemptor=3)]
    # a job of no higher priority than the grown one may take back only what it grew by: this one waits
    running = [grown, rigid_running(2, "a", 6, priority=HIGH)]
    plan = decide(shares=shares, capacity=CLUSTER, running=running, queue=[rigid_pending(3, "a", 7, priority=NORMAL)])
    assert plan.resize == [] and plan.preempt == [] and plan.wait[0].key == 3
    # nor does a job of lower priority than the grown one take anything
    plan = decide(shares=shares, capacity=CLUSTER, running=running, queue=[rigid_pending(3, "a", 5, priority=LOW)])
    assert plan.resize == [] and plan.preempt == [] and plan.wait[0].key == 3


def test_another_cohort_member_takes_back_what_a_borrower_grew_by():
    shares = {"a": share(8), "b": share(8), "c": share(8)}
    grown = Running(1, "a", gpus(12), NORMAL, elastic=Elastic(12, 2, 16), resized_at=LONG_AGO, base_nodes=4)
    plan = decide(shares=shares, capacity=Quota(gpus=20), running=[grown, rigid_running(2, "b", 8)],
                  queue=[rigid_pending(9, "b", 2)])  # b would borrow too: without the loan it could take nothing
    assert plan.resize == [Resize(1, 10, "QueueFirst", preemptor=9)] and plan.preempt == []


def test_a_job_grows_again_only_after_the_cool_down():
    shares = {"a": share(16, cohort=None)}
    plan = decide(shares=shares, capacity=CLUSTER, running=[elastic_running(1, "a", 4, 2, 8, resized_at=1000.0)],
                  queue=[], now=1000.0 + 60, resize_cooldown_s=600)
    assert plan.resize == []
    later = decide(shares=shares, capacity=CLUSTER, running=[elastic_running(1, "a", 4, 2, 8, resized_at=1000.0)],
                   queue=[], now=1000.0 + 600, resize_cooldown_s=600)
    assert sizes(later) == {1: (8, "IdleCapacity")}


def test_nothing_grows_where_preemption_is_off_since_nothing_lent_could_be_taken_back():
    plan = decide(shares={"a": share(16, cohort=None)}, capacity=CLUSTER,
                  running=[elastic_running(1, "a", 4, 2, 12)], queue=[], preemption=False)
    assert plan.resize == []


def test_nothing_grows_into_what_is_reserved_for_a_job_waiting_for_its_victims():
    shares = {"a": share(16, cohort=None)}
    running = [elastic_running(1, "a", 4, 2, 12), Running(2, "a", gpus(8), LOW, stopping=True)]
    plan = decide(shares=shares, capacity=CLUSTER, running=running, queue=[rigid_pending(3, "a", 12, priority=HIGH)])
    # 4 GPUs are idle now, but the high-priority job gets them with the 8 being freed: nobody grows into them
    assert plan.resize == [] and plan.wait[0].reason.startswith("preempted jobs")


def test_growth_is_fair_between_tenants_the_one_furthest_below_its_share_first():
    """a holds 8 of its 8, b 2 of its 8: of 6 idle GPUs b gets 6 first, up to its own share, then they alternate."""
    shares = {"a": share(8), "b": share(8)}
    running = [elastic_running(1, "a", 8, 1, 16), elastic_running(2, "b", 2, 1, 16)]
    assert sizes(decide(shares=shares, capacity=CLUSTER, running=running, queue=[])) == {2: (8, "IdleCapacity")}
    bigger = decide(shares=shares, capacity=Quota(gpus=20), running=running, queue=[])
    # the cohort's pool is 16: growth never takes the cohort beyond its members' quotas together
    assert sizes(bigger) == {2: (8, "IdleCapacity")}
    shares = {"a": share(8), "b": share(8), "c": share(8)}  # c lends 8 more: a and b share them, a node each in turn
    assert sizes(decide(shares=shares, capacity=Quota(gpus=24), running=running, queue=[])) == {
        1: (12, "IdleCapacity"), 2: (12, "IdleCapacity")}


def test_growth_keeps_to_the_borrowing_limit():
    shares = {"a": share(4, borrow=2), "b": share(12)}
    plan = decide(shares=shares, capacity=CLUSTER, running=[elastic_running(1, "a", 2, 1, 16)], queue=[])
    assert sizes(plan) == {1: (6, "IdleCapacity")}


def test_a_higher_priority_job_shrinks_an_elastic_job_instead_of_preempting_it():
    shares = {"a": share(16, cohort=None)}
    running = [elastic_running(1, "a", 12, 4, 12, priority=LOW), rigid_running(2, "a", 4, priority=LOW)]
    plan = decide(shares=shares, capacity=CLUSTER, running=running, queue=[rigid_pending(3, "a", 6, priority=HIGH)])
    assert plan.preempt == [] and plan.resize == [Resize(1, 6, "HigherPriority", preemptor=3)]
    assert plan.wait[0].key == 3 and plan.wait[0].reason.startswith("preempted jobs")  # its 6 GPUs reserved


def test_an_elastic_job_is_preempted_whole_only_when_its_minimum_must_go_too():
    shares = {"a": share(16, cohort=None)}
    running = [elastic_running(1, "a", 12, 4, 12, priority=LOW), rigid_running(2, "a", 4, priority=HIGH)]
    plan = decide(shares=shares, capacity=CLUSTER, running=running, queue=[rigid_pending(3, "a", 10, priority=HIGH)])
    # its 8 nodes above its minimum are not enough, and the other job is no victim: all of it goes
    assert [p.victim for p in plan.preempt] == [1] and plan.resize == []


@pytest.mark.parametrize("wanted", [pytest.param(n, id=f"{n}-gpus") for n in (1, 7, 8)])
def test_a_shrunk_job_gives_back_only_what_is_needed_and_never_goes_below_its_minimum(wanted):
    shares = {"a": share(16, cohort=None)}
    running = [elastic_running(1, "a", 12, 4, 12, priority=LOW), rigid_running(2, "a", 4, priority=LOW, at_risk=9)]
    plan = decide(shares=shares, capacity=CLUSTER, running=running,
                  queue=[rigid_pending(3, "a", wanted, priority=HIGH)])
    assert plan.preempt == [] and sizes(plan) == {1: (12 - wanted, "HigherPriority")}
    assert all(r.nodes >= 4 for r in plan.resize)


def test_shrinks_come_before_preemptions_whatever_the_order_of_victims():
    """The rigid job has less work at risk (it would be the first victim), but shrinking the other is enough."""
    shares = {"a": share(16, cohort=None)}
    running = [elastic_running(1, "a", 12, 4, 12, priority=LOW, at_risk=50.0),
               rigid_running(2, "a", 4, priority=LOW, at_risk=1.0)]
    plan = decide(shares=shares, capacity=CLUSTER, running=running, queue=[rigid_pending(3, "a", 4, priority=HIGH)])
    assert plan.preempt == [] and sizes(plan) == {1: (8, "HigherPriority")}


def test_a_lender_reclaims_from_an_elastic_borrower_by_shrinking_it_as_far_as_needed():
    shares = {"a": share(8), "b": share(8)}
    running = [elastic_running(1, "a", 14, 2, 16)]  # a borrows 6 of b's quota
    plan = decide(shares=shares, capacity=CLUSTER, running=running, queue=[rigid_pending(9, "b", 4)])
    assert plan.preempt == [] and plan.resize == [Resize(1, 12, "ReclaimedByLender", preemptor=9)]
    # b wants all 8: a gives back only what it borrowed, never what its own quota guarantees
    plan = decide(shares=shares, capacity=CLUSTER, running=running, queue=[rigid_pending(9, "b", 8)])
    assert plan.resize == [Resize(1, 8, "ReclaimedByLender", preemptor=9)] and plan.wait[0].key == 9


def test_a_lender_still_preempts_a_rigid_borrower_beside_an_elastic_one():
    shares = {"a": share(8), "b": share(8)}
    running = [rigid_running(1, "a", 4, at_risk=1.0), elastic_running(2, "a", 8, 6, 8, at_risk=2.0),
               rigid_running(3, "b", 4)]
    plan = decide(shares=shares, capacity=CLUSTER, running=running, queue=[rigid_pending(9, "b", 4)])
    # the elastic job can give back 2 nodes, not the 4 needed: it is spared, and the rigid borrower goes
    assert [(p.victim, p.reason) for p in plan.preempt] == [(1, "ReclaimedByLender")] and plan.resize == []


def test_a_job_giving_back_nodes_is_not_grown_and_what_it_frees_is_reserved():
    shares = {"a": share(16, cohort=None)}
    shrinking = Running(1, "a", gpus(12), LOW, elastic=Elastic(12, 4, 12), shrinking_to=6, resized_at=LONG_AGO)
    plan = decide(shares=shares, capacity=CLUSTER, running=[shrinking, elastic_running(2, "a", 2, 1, 8)],
                  queue=[rigid_pending(3, "a", 8, priority=HIGH)])
    assert plan.preempt == [] and plan.resize == [] and plan.admit == []
    assert plan.wait[0].reason.startswith("preempted jobs")


@pytest.mark.parametrize("seed", [pytest.param(seed, id=f"seed-{seed}") for seed in range(40)])
def test_whatever_happens_no_limit_is_passed_and_every_size_stays_within_its_range(seed):
    """Random tenants, cohorts and jobs, rigid and elastic, arriving and ending over 30 passes, each plan carried
    out at once: after every pass the capacity, each tenant's quota and borrowing limit and each cohort's pool
    hold, and every elastic job is within its range."""
    import random

    rng = random.Random(seed)
    shares = {t: share(rng.randint(2, 8), cohort=rng.choice(["x", None]), borrow=rng.choice([None, 2, 4]))
              for t in "abc"}
    capacity = Quota(gpus=rng.randint(8, 20))
    queued: dict[int, Pending] = {}
    active: dict[int, Running] = {}
    for now, key in enumerate(range(1, 31)):
        least = rng.randint(1, 4)
        job = (elastic_pending(key, rng.choice("abc"), least, least + rng.randint(1, 6), priority=rng.choice([LOW, HIGH]))
               if rng.random() < 0.6 else rigid_pending(key, rng.choice("abc"), rng.randint(1, 5),
                                                        priority=rng.choice([LOW, HIGH])))
        queued[key] = job
        for ended in [k for k in active if rng.random() < 0.15]:
            del active[ended]
        plan = decide(shares=shares, capacity=capacity, running=list(active.values()),
                      queue=sorted(queued.values(), key=lambda p: (-p.priority, p.key)), now=now * 1000.0)
        for p in plan.preempt:
            job = active.pop(p.victim)
            queued[job.key] = Pending(job.key, job.tenant, job.demand, job.priority, job.elastic)
        for r in plan.resize:
            job = active[r.key]
            assert job.elastic.min_nodes <= r.nodes <= job.elastic.max_nodes
            active[r.key] = dataclasses.replace(job, demand=job.demand.resized(job.elastic.nodes, r.nodes),
                                                elastic=dataclasses.replace(job.elastic, nodes=r.nodes),
                                                resized_at=now * 1000.0, base_nodes=r.nodes)
        for a in plan.admit:
            job = queued.pop(a.key)
            nodes = a.nodes if job.elastic else None
            demand = job.demand if nodes is None else job.demand.resized(job.elastic.nodes, nodes)
            if job.elastic:
                assert job.elastic.min_nodes <= nodes <= job.elastic.max_nodes
            active[a.key] = Running(a.key, job.tenant, demand, job.priority, resized_at=now * 1000.0,
                                    elastic=job.elastic and dataclasses.replace(job.elastic, nodes=nodes))
        held = {t: sum(j.demand.gpus for j in active.values() if j.tenant == t) for t in shares}
        assert sum(held.values()) <= capacity.gpus
        for t, s in shares.items():
            ceiling = s.nominal.gpus + (s.borrowing_limit.gpus if s.borrowing_limit.gpus is not None else 99)
            assert held[t] <= (ceiling if s.cohort else s.nominal.gpus)
        pool = sum(s.nominal.gpus for s in shares.values() if s.cohort == "x")
        assert sum(held[t] for t, s in shares.items() if s.cohort == "x") <= pool
