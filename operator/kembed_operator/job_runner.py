"""Runs one EmbeddingJob: observe, decide (job_state.decide), act, write status; sleep until a child changes.

One runner per job, started and stopped by Kopf (a daemon): it is the only writer of that job's status, so it
keeps the status it last wrote and never races itself. Children are read from the shared `Observed` view.

The status written right after a new gang is created (ADMITTED, its attempt's start time) is held back for up to
`first_status_delay_s`: when the gang's pods all run before that, the same changes go out with RUNNING in one
write. Until written, they count as the job's status for every decision; any other write carries them along.
Its Event ("Created") goes with it: posted when ADMITTED is written, left out when the status never says ADMITTED
(the RUNNING write's own Event tells the same story, and the batch Job's SuccessfulCreate says the pods exist).

A job that ends gets its last progress (rank 0's log) in the same write as its terminal phase, not one after.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import kopf
import pydantic
from kubernetes.client.rest import ApiException

from kembed_contract import resources, runtime
from kembed_contract.lifecycle import TERMINAL_STATES, JobState
from kembed_operator import job_manifests, job_state, progress
from kembed_operator.kube import Kube, is_not_found
from kembed_operator.observed import Observed
from kembed_operator.settings import OperatorSettings
from kembed_operator.views import JOB_LABEL

__all__ = ["JobRunner"]

_TERMINAL = {s.value for s in TERMINAL_STATES}


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class JobRunner:
    def __init__(self, *, kube: Kube, observed: Observed, settings: OperatorSettings, body: kopf.Body,
                 s3_prefix_of: Callable[[str], str | None], logger: logging.Logger | logging.LoggerAdapter,
                 storage_policy_of: Callable[[str], str] | None = None,
                 clock: Callable[[], datetime.datetime] = _utcnow) -> None:
        """`storage_policy_of(tenant)`: the tenant's storage policy as the trainers get it (JSON); None: trainers
        get none (tests of the runner alone)."""
        self.kube, self.observed, self.settings = kube, observed, settings
        self.body, self.logger, self.clock = body, logger, clock
        self.s3_prefix_of, self.storage_policy_of = s3_prefix_of, storage_policy_of
        self.name, self.namespace, self.uid = body.meta["name"], body.meta["namespace"], body.meta["uid"]
        self.key = (self.namespace, self.name)
        self.tenant = (body.meta.get("labels") or {}).get("kembed.io/tenant") or self.namespace.removeprefix(
            resources.NAMESPACE_PREFIX)
        self.status: dict[str, Any] = dict(body.get("status") or {})
        # The first progress read comes one interval after the runner starts, not on the first pass that sees the
        # gang running: a trainer that has just started has logged nothing worth a round trip to its node.
        self._last_log_read = time.monotonic()
        self._gone = False
        self._spec: tuple[int, resources.EmbeddingJobSpec] | None = None  # (generation, validated spec)
        self._held: dict[str, Any] = {}  # status changes not written yet (see the module docstring)
        self._held_until: datetime.datetime | None = None
        self._held_event: tuple[str, str, str] | None = None  # the held phase's Event, posted when it is written

    # ---- the loop --------------------------------------------------------------------------------------------
    async def run(self, stopped: kopf.DaemonStopped) -> None:
        if self.status.get("phase"):
            await self._prime()  # after a restart or a take-over: never judge a running gang by an empty view
        wakeup = self.observed.wakeup(self.key)

        async def until_stopped() -> None:
            await stopped.wait()

        stopping = asyncio.ensure_future(until_stopped())
        try:
            while not stopped and not self._gone:
                wakeup.clear()
                sleep_s = await self.reconcile_once()
                waking = asyncio.ensure_future(wakeup.wait())
                await asyncio.wait([waking, stopping], timeout=sleep_s, return_when=asyncio.FIRST_COMPLETED)
                waking.cancel()
        finally:
            stopping.cancel()
            self.observed.forget(self.key)
            if self._held and not self._gone:  # stopped (a restart, a take-over) before their time: write them now
                with contextlib.suppress(Exception):
                    await self._write_status({}, due=self._held_until)

    async def reconcile_once(self) -> float:
        now = self.clock()
        generation = int(self.body.meta.get("generation") or 0)
        try:
            spec = self._validated_spec(generation)
        except pydantic.ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            plan = job_state.invalid_spec_plan(self.status, generation, now, f"spec.{where}: {first['msg']}")
            await self._write_status(plan.status)
            self._post(plan.event)
            return self.settings.resync_interval_s
        plan = job_state.decide(
            spec=spec, status={**self.status, **self._held}, generation=generation,
            batch_job=self.observed.batch_job(self.key), pods=self.observed.pods(self.key), now=now,
            settings=self.settings,
        )
        if plan.action is job_state.Action.CREATE_GANG:
            await self._create_gang(spec)  # create first: the status then says what exists
            self._hold(plan.status, until=now + datetime.timedelta(seconds=self.settings.first_status_delay_s),
                       event=plan.event)
            await self._write_status({}, due=now)
        else:
            ending = plan.status.get("phase") in _TERMINAL
            # The end and the last progress in one write: rank 0's final records are read before it goes out.
            last_progress = await self._progress_changes(force=True) if ending else {}
            # Intent first: a restart is recorded before the gang goes.
            await self._write_status({**last_progress, **plan.status})
            if plan.action is not None:
                await self._carry_out(plan.action, spec)
            self._post(plan.event)
            if not ending:
                await self._write_status(await self._progress_changes(force=False))
        await self._write_status({}, due=now)  # held changes whose time has come
        ttl_left = job_state.seconds_until_ttl(self.status, now, self.settings)
        sleep_s = min(self.settings.resync_interval_s, ttl_left + 0.5) if ttl_left is not None else (
            self.settings.resync_interval_s)
        if self._held_until is not None:
            sleep_s = min(sleep_s, max(0.0, (self._held_until - now).total_seconds()))
        return sleep_s

    def _validated_spec(self, generation: int) -> resources.EmbeddingJobSpec:
        """The spec, validated once per generation: every pod event wakes the runner, the spec rarely changes."""
        if self._spec is None or self._spec[0] != generation:
            self._spec = (generation, resources.EmbeddingJobSpec.model_validate(dict(self.body.spec)))
        return self._spec[1]

    # ---- acting ----------------------------------------------------------------------------------------------
    async def _prime(self) -> None:
        selector = f"{JOB_LABEL}={self.name}"
        pods = await self.kube.run(self.kube.core.list_namespaced_pod, self.namespace, label_selector=selector)
        for pod in pods.items:
            self.observed.record_pod(None, self.kube.api.sanitize_for_serialization(pod))
        try:
            job = await self.kube.run(self.kube.batch.read_namespaced_job, self.name, self.namespace)
            self.observed.record_job(None, self.kube.api.sanitize_for_serialization(job))
        except ApiException as error:
            if not is_not_found(error):
                raise

    async def _create_gang(self, spec: resources.EmbeddingJobSpec) -> None:
        attempt = int(self.status.get("attempt") or 0)
        prefix = self.s3_prefix_of(self.tenant)
        checkpoint_uri = runtime.job_checkpoint_folder(prefix, self.name) if prefix else None
        args = (self.name, self.namespace, self.uid, self.tenant)
        files = job_manifests.trainer_files(spec, default_checkpoint_uri=checkpoint_uri)
        side_children = job_manifests.side_children(*args, spec, files, self.settings)
        manifest = job_manifests.batch_job(
            *args, spec, attempt=attempt, settings=self.settings, files=files,
            storage_policy=self.storage_policy_of(self.tenant) if self.storage_policy_of else None)
        # All at once: the batch Job's pods need a ConfigMap (if any) only when their containers start (the kubelet
        # waits for it) and the Service (if any) only at rendezvous. But once the batch Job exists no later pass
        # creates the gang again, so the side children are retried here until they exist.
        outcomes = await asyncio.gather(self.kube.run(self.kube.create, manifest),
                                        self._ensure_side_children(side_children, spec), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        created = outcomes[0]
        if created is None:  # it exists already (we made it before a restart): let the view know
            existing = await self.kube.run(self.kube.batch.read_namespaced_job, self.name, self.namespace)
            created = self.kube.api.sanitize_for_serialization(existing)
        self.observed.record_job(None, created)

    async def _ensure_side_children(self, manifests: list[dict[str, Any]], spec: resources.EmbeddingJobSpec) -> None:
        steps: list[Callable[[], Awaitable[Any]]] = [
            functools.partial(self.kube.run, self.kube.create_or_apply, m) for m in manifests]
        steps.append(functools.partial(self._own_report_token, spec))
        for delay_s in (1, 2, 4, 8, None):
            outcomes = await asyncio.gather(*(step() for step in steps), return_exceptions=True)
            failed = [(step, o) for step, o in zip(steps, outcomes, strict=True) if isinstance(o, BaseException)]
            if not failed:
                return
            if delay_s is None:
                raise failed[0][1]
            self.logger.warning("children of %s not all created (%s); again in %ss", self.name, failed[0][1], delay_s)
            steps = [step for step, _ in failed]
            await asyncio.sleep(delay_s)

    async def _own_report_token(self, spec: resources.EmbeddingJobSpec) -> None:
        """The API's per-job token Secret goes when the job goes: the EmbeddingJob becomes its owner."""
        if not spec.report_token_secret:
            return
        owner = {**job_manifests.owner_reference(self.name, self.uid), "controller": False}
        try:
            await self.kube.run(self.kube.merge_patch, "v1", "Secret", spec.report_token_secret, self.namespace,
                                {"metadata": {"ownerReferences": [owner]}})
        except ApiException as error:
            if not is_not_found(error):
                raise
            self._post(("Warning", "ReportTokenMissing",
                        f"Secret {spec.report_token_secret} not found: the trainer runs but cannot report to the API"))

    async def _carry_out(self, action: job_state.Action, spec: resources.EmbeddingJobSpec) -> None:
        batch_job = self.observed.batch_job(self.key)
        if action is job_state.Action.DELETE_GANG and batch_job is not None:
            # Foreground: the Job stays (deleting) until its pods are gone, so the next gang never meets them.
            await self.kube.run(self.kube.delete, "batch/v1", "Job", self.name, self.namespace,
                                propagation="Foreground", uid=batch_job.uid)
        elif action in (job_state.Action.SUSPEND_GANG, job_state.Action.RESUME_GANG):
            suspend = action is job_state.Action.SUSPEND_GANG
            try:
                await self.kube.run(self.kube.merge_patch, "batch/v1", "Job", self.name, self.namespace,
                                    {"spec": {"suspend": suspend}})
            except ApiException as error:
                if not is_not_found(error):
                    raise
        elif action is job_state.Action.REMOVE_CHILDREN:
            for api_version, kind, name in [("batch/v1", "Job", self.name), ("v1", "Service", self.name),
                                            ("v1", "ConfigMap", self.name)] + (
                    [("v1", "Secret", spec.report_token_secret)] if spec.report_token_secret else []):
                await self.kube.run(self.kube.delete, api_version, kind, name, self.namespace)

    def _hold(self, changes: dict[str, Any], *, until: datetime.datetime,
              event: tuple[str, str, str] | None = None) -> None:
        self._held.update(changes)
        if self._held_until is None or until < self._held_until:
            self._held_until = until
        if event is not None:
            self._held_event = event

    async def _write_status(self, changes: dict[str, Any], *, due: datetime.datetime | None = None) -> None:
        """Merge-patches `changes` with whatever is held; with only held changes, once `due` reaches their time."""
        held_event = None
        if self._held and (changes or (due is not None and self._held_until is not None and due >= self._held_until)):
            # The held phase's Event goes out only if that phase is what the status will say.
            if changes.get("phase", self._held.get("phase")) == self._held.get("phase"):
                held_event = self._held_event
            changes = {**self._held, **changes}
            self._held, self._held_until, self._held_event = {}, None, None
        if not changes:
            return
        try:
            updated = await self.kube.run(self.kube.patch_custom_status, resources.EMBEDDING_JOB_PLURAL, self.name,
                                          self.namespace, changes)
        except ApiException as error:
            if is_not_found(error):
                self._gone = True
                return
            raise
        self.status = dict(updated.get("status") or {})
        self._post(held_event)

    def _post(self, event: tuple[str, str, str] | None) -> None:
        if event is not None:
            kind, reason, message = event
            kopf.event(self.body, type=kind, reason=reason, message=message[:1000])

    # ---- progress from rank 0's records --------------------------------------------------------------------------
    async def _progress_changes(self, *, force: bool) -> dict[str, Any]:
        """What rank 0's latest records change in the status: read at the interval while the gang runs, or now."""
        running = self.status.get("phase") in (JobState.RUNNING.value, JobState.RESTARTING.value)
        due = time.monotonic() - self._last_log_read >= self.settings.progress_interval_s
        if not (force or (running and due)):
            return {}
        attempt = int(self.status.get("attempt") or 0)
        rank0 = [p for p in self.observed.pods(self.key) if p.attempt == attempt and p.index == 0
                 and p.phase in ("Running", "Succeeded", "Failed")]
        if not rank0:
            return {}
        self._last_log_read = time.monotonic()
        try:
            text = await self.kube.run(self.kube.pod_log_tail, rank0[0].name, self.namespace, lines=200)
        except Exception as error:  # noqa: BLE001 - progress is a nicety; a node without logs must not stop the job
            self.logger.debug("no log of %s: %s", rank0[0].name, error)
            return {}
        return {name: value for name, value in progress.read_records(text).items() if value != self.status.get(name)}
