"""What whoever runs kembed uses: serve the embedded default, migrate a database, and the demo."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from kembed_api.cli.client import Client
from kembed_api.cli.common import (
    ADMIN_TOKEN_FILE,
    console,
    fail,
)
from kembed_api.cli.jobs import exit_with, follow_job
from kembed_api.platform.ports import free_port

__all__ = ["demo", "migrate", "serve"]


def serve(
    host: Annotated[str, typer.Option(help="Address to bind; loopback by default.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
    data_dir: Annotated[Path, typer.Option(help="Database, logs and checkpoints of the embedded default.")] = Path(
        ".kembed"
    ),
    slots: Annotated[int | None, typer.Option(help="Trainer processes run at once (default: cores).")] = None,
    workers: Annotated[int | None, typer.Option(help="HTTP worker processes (default 1, or KEMBED_WORKERS).")] = None,
    read_prefix: Annotated[list[str] | None, typer.Option(
        "--read-prefix", help="A folder (or file://, s3:// prefix) the default tenant's jobs may read from now on, "
        "e.g. your own data; repeat for more.")] = None,
) -> None:
    """Run the embedded server: API + SQLite + local backend, on this machine."""
    import uvicorn

    from kembed_api.app import create_app
    from kembed_api.platform.settings import Settings

    overrides: dict[str, Any] = {"host": host, "port": port, "data_dir": data_dir}
    if slots is not None:
        overrides["local_slots"] = slots
    if workers is not None:
        overrides["workers"] = workers
    if read_prefix:
        overrides["default_tenant_read_prefixes"] = [str(Path(p).expanduser().absolute()) if "://" not in p else p
                                                     for p in read_prefix]
    settings = Settings(**overrides)
    console.print(f"kembed serving on [bold]http://{host}:{port}[/bold] (data in {settings.data_dir}"
                  + (f", {settings.workers} worker processes)" if settings.workers > 1 else ")"))
    console.print(f"dashboard: [bold]http://{host}:{port}/dashboard[/bold] (sign in with an API token)")
    if settings.workers == 1:
        uvicorn.run(create_app(settings), host=host, port=port, log_level="warning")
    else:
        from kembed_api.platform.workers import WorkersKeepDying, serve_workers

        try:
            serve_workers(settings, overrides)
        except WorkersKeepDying as error:
            fail(error)


def migrate() -> None:
    """Bring the database (KEMBED_DATABASE_URL, or SQLite in KEMBED_DATA_DIR) to the newest schema, then exit.

    `kembed serve` does this on every start too; a Kubernetes install runs it once before the API pods start."""
    from kembed_api.platform.db import upgrade_to_head
    from kembed_api.platform.settings import Settings

    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(settings.resolved_database_url)
    console.print("database schema is up to date")



def _wait_healthy(client: Client, server: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            fail(RuntimeError(f"the server exited with code {server.returncode}"))
        try:
            client.health()
            return
        except Exception:  # noqa: BLE001 (not up yet)
            time.sleep(0.3)
    fail(TimeoutError(f"the server did not answer within {timeout_s:.0f}s"))


def demo(
    data_dir: Annotated[Path, typer.Option(help="Where the demo server keeps its state (emptied first).")] = Path(
        ".kembed/demo"
    ),
) -> None:
    """Start the embedded server, submit the sample CTR job (samples/demo-ctr.yaml) over HTTP and follow it to the end."""
    shutil.rmtree(data_dir, ignore_errors=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    console.rule("kembed demo")
    console.print(f"starting the embedded server on {url} (data in {data_dir})")
    server = subprocess.Popen(
        [sys.executable, "-m", "kembed_api.cli", "serve", "--port", str(port), "--data-dir", str(data_dir)],
        stdout=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        with Client(url) as probe:
            _wait_healthy(probe, server)
        token = (data_dir / ADMIN_TOKEN_FILE).read_text().strip()
        console.print(f"dashboard: [bold]{url}/dashboard[/bold] while the demo runs "
                      f"(sign in with the token in {data_dir / ADMIN_TOKEN_FILE})")
        with Client(url, token=token) as client:
            spec = yaml.safe_load(resources.files("kembed_api.samples").joinpath("demo-ctr.yaml").read_text())
            console.print(f"POST {url}/v1/jobs  (sample job: {spec['name']}, "
                          f"{spec['trainer']['model']['kind']} on synthetic Zipf click data)")
            job = client.submit(spec)
            console.print(f"submitted [bold]{job['id']}[/bold]")
            job = follow_job(client, job["id"])
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    exit_with(job)
