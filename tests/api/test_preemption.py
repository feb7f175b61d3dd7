"""The admission core over cohorts and priority classes, pure: borrowing limits, reclaim, victim choice, fairness."""

from __future__ import annotations

from kembed_api.quota.admission import Demand, Quota
from kembed_api.quota.preemption import Admit, Pending, Running, Share, decide

LOW, NORMAL, HIGH = 0, 100, 1000


def gpus(n: int) -> Demand:
    return Demand(gpus=n, running_jobs=1)


def share(nominal: int, *, cohort: str | None = "research", borrow: int | None = None) -> Share:
    return Share(nominal=Quota(gpus=nominal), cohort=cohort, borrowing_limit=Quota(gpus=borrow))


def running(key, tenant, n, *, priority=NORMAL, at_risk=0.0, stopping=False, protected=False) -> Running:
    return Running(key, tenant, gpus(n), priority, work_at_risk=at_risk, stopping=stopping, protected=protected)


def pending(key, tenant, n, *, priority=NORMAL) -> Pending:
    return Pending(key, tenant, gpus(n), priority)


CLUSTER = Quota(gpus=16)


def test_a_tenant_borrows_idle_quota_of_its_cohort_up_to_its_borrowing_limit():
    shares = {"a": share(8, borrow=4), "b": share(8)}
    plan = decide(shares=shares, capacity=CLUSTER, running=[],
                  queue=[pending(1, "a", 8), pending(2, "a", 4), pending(3, "a", 4)])
    assert plan.admit == [Admit(1, borrowed=False), Admit(2, borrowed=True)]
    assert [(w.key, w.reason.split(":")[0]) for w in plan.wait] == [(3, "borrowing limit")]


def test_rigid_quotas_lend_nothing():
    shares = {"a": share(8, cohort=None), "b": share(8, cohort=None)}
    plan = decide(shares=shares, capacity=CLUSTER, running=[], queue=[pending(1, "a", 8), pending(2, "a", 8)])
    assert [a.key for a in plan.admit] == [1] and "quota.gpus" in plan.wait[0].reason


def test_a_lender_reclaims_its_quota_from_the_borrower_with_the_least_work_at_risk():
    shares = {"a": share(8), "b": share(8)}
    borrowers = [running(1, "a", 8, at_risk=90.0), running(2, "a", 4, at_risk=50.0), running(3, "a", 4, at_risk=10.0)]
    plan = decide(shares=shares, capacity=CLUSTER, running=borrowers, queue=[pending(9, "b", 4)])
    assert [(p.victim, p.preemptor, p.reason) for p in plan.preempt] == [(3, 9, "ReclaimedByLender")]
    assert plan.admit == [] and plan.wait[0].reason.startswith("preempted jobs")


def test_never_more_victims_than_needed():
    shares = {"a": share(8), "b": share(8)}
    # the smallest-risk victim alone is too small; the second suffices by itself, so the first is spared
    borrowers = [running(1, "a", 8, at_risk=90.0), running(2, "a", 2, at_risk=1.0), running(3, "a", 6, at_risk=2.0)]
    plan = decide(shares=shares, capacity=CLUSTER, running=borrowers, queue=[pending(9, "b", 6)])
    assert [p.victim for p in plan.preempt] == [3]


def test_what_a_tenant_holds_within_its_nominal_quota_is_never_taken_by_another():
    shares = {"a": share(8), "b": share(8)}
    plan = decide(shares=shares, capacity=CLUSTER, running=[running(1, "a", 8), running(2, "b", 8, priority=LOW)],
                  queue=[pending(9, "a", 8, priority=HIGH)])
    # a would borrow, b does not: b's lower-priority job stays, a's own lower-priority job makes room
    assert [p.victim for p in plan.preempt] == [1]


def test_a_higher_priority_class_preempts_its_own_tenants_lower_jobs_lowest_first():
    shares = {"a": share(8, cohort=None)}
    jobs = [running(1, "a", 4, priority=NORMAL, at_risk=0.0), running(2, "a", 4, priority=LOW, at_risk=99.0)]
    plan = decide(shares=shares, capacity=CLUSTER, running=jobs, queue=[pending(9, "a", 4, priority=HIGH)])
    assert [(p.victim, p.reason) for p in plan.preempt] == [(2, "HigherPriority")]


def test_capacity_is_made_by_preempting_lower_priority_jobs_too():
    """The embedded default: one tenant with no quota, the machine's slots are the limit."""
    slots = Quota(max_processes=2)
    shares = {"default": Share(nominal=Quota())}
    jobs = [Running(1, "default", Demand(processes=2, running_jobs=1), LOW)]
    plan = decide(shares=shares, capacity=slots, running=jobs,
                  queue=[Pending(9, "default", Demand(processes=1, running_jobs=1), HIGH)])
    assert [p.victim for p in plan.preempt] == [1]


def test_while_victims_save_nobody_else_is_preempted_and_what_they_free_is_reserved():
    shares = {"a": share(8), "b": share(8)}
    jobs = [running(1, "a", 8), running(2, "a", 8, stopping=True)]
    plan = decide(shares=shares, capacity=CLUSTER, running=jobs, queue=[pending(9, "b", 8), pending(10, "a", 8)])
    assert plan.preempt == [] and plan.admit == []
    assert {w.key: w.reason.split(":")[0] for w in plan.wait} == {
        9: "preempted jobs to save their checkpoint and stop", 10: "quota.gpus"}


def test_a_protected_job_gives_way_to_no_higher_class_and_nobody_is_preempted_in_vain():
    shares = {"a": share(8, cohort=None)}
    jobs = [running(1, "a", 4, priority=LOW, protected=True), running(2, "a", 4, priority=LOW)]
    plan = decide(shares=shares, capacity=CLUSTER, running=jobs, queue=[pending(9, "a", 8, priority=HIGH)])
    assert plan.preempt == [] and plan.wait[0].key == 9  # one victim would not make room: none at all


def test_a_lender_reclaims_even_from_a_protected_borrower():
    shares = {"a": share(8), "b": share(8)}
    jobs = [running(1, "a", 8, protected=True, at_risk=1.0), running(2, "a", 8, protected=True, at_risk=2.0)]
    plan = decide(shares=shares, capacity=CLUSTER, running=jobs, queue=[pending(9, "b", 8)])
    assert [(p.victim, p.reason) for p in plan.preempt] == [(1, "ReclaimedByLender")]


def test_jobs_within_their_nominal_quota_go_before_jobs_that_would_borrow():
    """Fairness: b's guaranteed share is not handed to a's older job first and then taken back."""
    shares = {"a": share(8), "b": share(8)}
    plan = decide(shares=shares, capacity=CLUSTER, running=[running(1, "a", 8)],
                  queue=[pending(2, "a", 8), pending(3, "b", 8)])
    assert plan.admit == [Admit(3, borrowed=False)] and plan.preempt == []


def test_the_head_of_a_tenants_queue_is_never_overtaken():
    shares = {"a": share(8, cohort=None)}
    plan = decide(shares=shares, capacity=CLUSTER, running=[running(1, "a", 4)],
                  queue=[pending(2, "a", 8), pending(3, "a", 2)])
    assert plan.admit == [] and [w.key for w in plan.wait] == [2]
