"""The FastAPI application: wiring of settings, database, backend and dispatcher."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kembed_api import __version__
from kembed_api.backends.base import Backend
from kembed_api.backends.local import LocalBackend
from kembed_api.db import Database, upgrade_to_head
from kembed_api.dispatcher import Dispatcher
from kembed_api.jobs import router as jobs_router
from kembed_api.settings import Backend as BackendKind
from kembed_api.settings import Settings

__all__ = ["create_app"]


def _make_backend(settings: Settings) -> Backend:
    if settings.backend is BackendKind.local:
        return LocalBackend(data_dir=settings.data_dir, slots=settings.local_slots,
                            stop_grace_s=settings.stop_grace_s)
    raise ValueError(f"backend {settings.backend.value!r} is not available in this build")


def create_app(settings: Settings | None = None, *, backend: Backend | None = None) -> FastAPI:
    """The app; `backend` replaces the one the settings name (tests of the HTTP layer use a fake)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        upgrade_to_head(settings.resolved_database_url)
        db = Database(settings.resolved_database_url)
        dispatcher = Dispatcher(db=db, backend=backend or _make_backend(settings), public_url=settings.resolved_public_url,
                                interval_s=settings.dispatch_interval_s)
        app.state.settings, app.state.db, app.state.dispatcher = settings, db, dispatcher
        app.state.backend = dispatcher.backend
        dispatcher.start()
        try:
            yield
        finally:
            dispatcher.stop()
            db.dispose()

    app = FastAPI(
        title="kembed",
        version=__version__,
        summary="Training-as-a-service for large sparse-embedding models.",
        description="Submit embedding-training jobs, follow their progress, read their logs and checkpoints.",
        lifespan=lifespan,
    )
    app.include_router(jobs_router.router)

    @app.get("/healthz", tags=["health"], summary="Liveness: the server answers")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
