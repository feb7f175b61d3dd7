"""The FastAPI application: wiring of settings, database, backend, dispatcher, metrics and routes."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kembed_api import __version__
from kembed_api.auth import ratelimit
from kembed_api.auth.cache import TtlCache
from kembed_api.auth.principal import MetricsCaller, MetricsView
from kembed_api.auth.service import ensure_bootstrap_token
from kembed_api.backends.base import Backend
from kembed_api.backends.local import LocalBackend
from kembed_api.dashboard import pages as dashboard_pages
from kembed_api.dashboard import router as dashboard_router
from kembed_api.jobs import router as jobs_router
from kembed_api.jobs.forecasts import Forecasts
from kembed_api.jobs.intake import Intake
from kembed_api.platform import bodies, errors
from kembed_api.platform.db import Database, upgrade_to_head
from kembed_api.platform.settings import Backend as BackendKind
from kembed_api.platform.settings import Settings
from kembed_api.platform.storage import PlatformStorage
from kembed_api.scheduling.dispatcher import Dispatcher
from kembed_api.scheduling.observability import Metrics, TenantTotals, configure_json_logging
from kembed_api.tenants import router as tenants_router
from kembed_api.tenants.service import ensure_tenant, fill_unset_storage, grant_read
from kembed_platform.tenant_credentials import TenantCredentials

__all__ = ["ADMIN_TOKEN_FILE", "create_app"]

log = logging.getLogger(__name__)
ADMIN_TOKEN_FILE = "admin-token"  # the CLI reads it (kembed_api.cli.common.ADMIN_TOKEN_FILE)


def platform_storage(settings: Settings) -> PlatformStorage:
    """The platform's side of every tenant's storage policy; raises ValueError for bad default prefixes."""
    return PlatformStorage.of(checkpoint_root=settings.resolved_checkpoint_root, data_dir=settings.data_dir,
                              default_read=settings.storage_read_prefixes,
                              default_write=settings.storage_write_prefixes)


def _make_backend(settings: Settings) -> Backend:
    if settings.backend is BackendKind.local:
        credentials = None
        if settings.s3_mint_credentials:
            credentials = TenantCredentials.connect(endpoint_url=settings.s3_iam_endpoint_url,
                                                    user_prefix=settings.s3_iam_user_prefix)
        return LocalBackend(data_dir=settings.data_dir, slots=settings.local_slots, sandbox=settings.trainer_sandbox,
                            stop_grace_s=settings.stop_grace_s, credentials=credentials,
                            server_s3_credentials=settings.trainer_server_s3_credentials,
                            limits=settings.trainer_limits, log_bytes_per_node=settings.trainer_log_bytes_per_node,
                            kernel_cache_root=settings.kernel_cache_dir if settings.trainer_kernel_cache else None)
    from kembed_api.backends.kubernetes import (
        KubernetesBackend,  # imports the kubernetes client only when used
    )

    return KubernetesBackend()


def _limits(settings: Settings) -> ratelimit.Limits:
    rate = ratelimit.Rate
    return ratelimit.Limits(
        token=rate(settings.rate_token_per_s, settings.rate_token_burst),
        tenant=rate(settings.rate_tenant_per_s, settings.rate_tenant_burst),
        report=rate(settings.rate_report_per_s, settings.rate_report_burst),
        auth_failures=rate(settings.rate_auth_failures_per_s, settings.rate_auth_failures_burst),
        heavy_in_flight=settings.heavy_in_flight_per_tenant, in_flight=settings.in_flight_per_tenant,
        max_body_bytes=settings.max_body_bytes)


def _bootstrap(settings: Settings, db: Database, storage: PlatformStorage) -> None:
    """The default tenant, and the first admin token: minted once, shown once, kept only as a 0600 file.
    Tenants from before storage policies existed get the platform's default policy."""
    secret = settings.bootstrap_admin_token.get_secret_value() if settings.bootstrap_admin_token else None
    with db.session(write=True) as session:
        db.lock_across_replicas(session)  # replicas starting together on a new database bootstrap one at a time
        tenant = ensure_tenant(session, name=settings.default_tenant, quota=settings.default_quota)
        if settings.default_tenant_read_prefixes:
            grant_read(tenant, settings.default_tenant_read_prefixes, storage=storage)
        fill_unset_storage(session, storage=storage)
        minted = ensure_bootstrap_token(session, tenant=tenant, secret=secret) if settings.auth else None
    if minted:
        path = settings.data_dir / ADMIN_TOKEN_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(minted + "\n")
        print(f"kembed: bootstrap platform-admin token (shown once, also in {path}):\n  {minted}", flush=True)


def create_app(settings: Settings | None = None, *, backend: Backend | None = None) -> FastAPI:
    """The app; `backend` replaces the one the settings name (tests of the HTTP layer use a fake)."""
    settings = settings or Settings()
    if settings.json_logs:
        configure_json_logging()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        # The database, tokens and logs are the server's alone. A directory it does not own is one mounted for it
        # (a Kubernetes emptyDir: root's, mode 0777, private to the pod), which it may not chmod: left as it is.
        if settings.data_dir.stat().st_uid == os.geteuid():
            settings.data_dir.chmod(0o700)
        storage = platform_storage(settings)
        upgrade_to_head(settings.resolved_database_url)
        db = Database(settings.resolved_database_url, processes=settings.workers)
        _bootstrap(settings, db, storage)
        await db.open_read_pool()
        metrics = Metrics(db)
        dispatcher = Dispatcher(db=db, backend=backend or _make_backend(settings),
                                public_url=settings.resolved_public_url, interval_s=settings.dispatch_interval_s,
                                metrics=metrics, admission_paused=settings.admission_paused,
                                priority_classes=settings.priority_classes,
                                protect_after=settings.preemption_protect_after,
                                protect_window_s=settings.preemption_protect_window_s,
                                leader_lock=settings.data_dir / "dispatcher.lock" if settings.workers > 1 else None,
                                storage=storage)
        app.state.settings, app.state.db, app.state.metrics = settings, db, metrics
        app.state.storage = storage
        app.state.dispatcher, app.state.backend = dispatcher, dispatcher.backend
        app.state.forecasts = forecasts = Forecasts(db, capacity=dispatcher.backend.capacity)
        app.state.principals = TtlCache(ttl_s=settings.token_cache_s)
        app.state.intake = intake = Intake(db, storage=storage,
                                           check_fits=dispatcher.backend.check_fits,
                                           priority_classes=settings.priority_classes)
        intake.start()
        dispatcher.start()
        # What is alive now (~120k objects: modules, models, mappers) lives as long as the server: into the
        # collector's permanent generation, so that a full collection walks only what requests create. Walking it
        # all took 70-180 ms of wall time on the loaded 2-core machine, the longest waits a request saw
        # (docs/benchmarks.md, API load).
        gc.collect()
        gc.freeze()
        log.info("kembed API ready (backend %s, database %s)", settings.backend.value, db.engine.url.get_backend_name())
        try:
            yield
        finally:
            intake.stop()
            dispatcher.stop()
            forecasts.close()
            await db.aclose()

    app = FastAPI(
        title="kembed",
        version=__version__,
        summary="Training-as-a-service for large sparse-embedding models.",
        description=(
            "Submit embedding-training jobs, follow their progress, read their logs, metrics and checkpoints. "
            "Every call but `/healthz` and `/metrics` needs `Authorization: Bearer <token>`; a token belongs to "
            "one tenant and sees only that tenant's jobs."
        ),
        lifespan=lifespan,
    )
    errors.install(app)
    app.add_middleware(bodies.BodyGuard, max_bytes=settings.max_body_bytes)
    if settings.rate_limits:  # added last, so outermost: a refused request is not even read
        app.add_middleware(ratelimit.RateLimits, limits=_limits(settings))
    app.include_router(jobs_router.router)
    app.include_router(tenants_router.router)
    app.include_router(dashboard_router.router)
    app.state.overviews = dashboard_router.RecentAnswers(max_age_s=1.0)  # the team pages' shared answers
    # The dashboard: pages and their static files, from this process and port (docs/dashboard.md).
    app.include_router(dashboard_pages.router)
    app.mount(f"{dashboard_pages.HOME}/static", StaticFiles(directory=dashboard_pages.STATIC_DIR), name="static")

    @app.get("/healthz", tags=["operations"], summary="Liveness: the server answers")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", tags=["operations"], summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}},
                              "description": "Per tenant for the scrape token or a platform admin; else totals."},
                        **errors.responses(401, 403)})
    def metrics(request: Request, view: MetricsCaller) -> Response:
        registry = request.app.state.metrics.registry
        shown = registry if view is MetricsView.PER_TENANT else TenantTotals(registry)
        return Response(generate_latest(shown), media_type=CONTENT_TYPE_LATEST)

    return app
