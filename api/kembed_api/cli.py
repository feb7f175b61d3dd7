"""`kembed`: the command line of kembed (serve the embedded default, submit and follow jobs)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from kembed_api.client import ApiError, Client
from kembed_api.ports import free_port
from kembed_contract import kinds, lifecycle
from kembed_contract import trainer_config as config
from kembed_contract.lifecycle import JobState

# Also written by kembed_api.app; repeated here so the CLI's client commands don't import the server.
ADMIN_TOKEN_FILE = "admin-token"

__all__ = ["app"]

app = typer.Typer(help="kembed: training-as-a-service for sparse-embedding models.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
# soft_wrap: long URIs and messages stay on one line, so they can be copied and grepped.
console = Console(soft_wrap=True)

ServerOption = Annotated[
    str, typer.Option("--server", envvar="KEMBED_SERVER", help="URL of the kembed API.")
]
TERMINAL = {state.value for state in lifecycle.TERMINAL_STATES}
_TONE_COLOUR = {lifecycle.Tone.ACTIVE: "cyan", lifecycle.Tone.TROUBLE: "yellow", lifecycle.Tone.STOPPED: "magenta",
                lifecycle.Tone.GOOD: "green", lifecycle.Tone.BAD: "red"}
STATE_STYLE = {state: _TONE_COLOUR.get(tone) for state, tone in lifecycle.STATE_TONES.items()}


def _token() -> str | None:
    """KEMBED_TOKEN, else the admin token the embedded server wrote into its data dir (KEMBED_DATA_DIR)."""
    if os.environ.get("KEMBED_TOKEN"):
        return os.environ["KEMBED_TOKEN"]
    path = Path(os.environ.get("KEMBED_DATA_DIR", ".kembed")) / ADMIN_TOKEN_FILE
    return path.read_text().strip() if path.is_file() else None


def _client(server: str) -> Client:
    return Client(server, token=_token())


def _request(server: str, call: Callable[[Client], Any]) -> Any:
    """One API call; an API error ends the command with its message and exit code 1."""
    with _client(server) as client:
        try:
            return call(client)
        except ApiError as error:
            _fail(error)
        except httpx.TransportError as error:
            _fail(RuntimeError(f"cannot reach the kembed API at {server} ({error}); is `kembed serve` running?"))


def _fail(error: ApiError | Exception) -> None:
    console.print(f"[red]error:[/red] {error}")
    raise typer.Exit(1)


def _state(state: str, width: int = 0) -> str:
    """The state coloured, padded to `width` before the markup so columns line up."""
    text, style = state.ljust(width), STATE_STYLE.get(state)
    return f"[{style}]{text}[/{style}]" if style else text


# ----------------------------------------------------------------------------------------------- serve
@app.command()
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
    from kembed_api.settings import Settings

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
        from kembed_api.workers import WorkersKeepDying, serve_workers

        try:
            serve_workers(settings, overrides)
        except WorkersKeepDying as error:
            _fail(error)


@app.command()
def migrate() -> None:
    """Bring the database (KEMBED_DATABASE_URL, or SQLite in KEMBED_DATA_DIR) to the newest schema, then exit.

    `kembed serve` does this on every start too; a Kubernetes install runs it once before the API pods start."""
    from kembed_api.db import upgrade_to_head
    from kembed_api.settings import Settings

    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade_to_head(settings.resolved_database_url)
    console.print("database schema is up to date")


# ----------------------------------------------------------------------------------------------- jobs
def _load_spec(path: Path) -> dict[str, Any]:
    try:
        spec = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        _fail(error)
    if not isinstance(spec, dict):
        _fail(ValueError(f"{path}: expected a YAML mapping (a job spec)"))
    return spec


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Job spec (YAML or JSON).")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Show live progress until the job ends.")] = False,
    server: ServerOption = "http://127.0.0.1:8080",
) -> None:
    """Submit a job."""
    with _client(server) as client:
        try:
            job = client.submit(_load_spec(file))
        except ApiError as error:
            _fail(error)
        console.print(f"submitted [bold]{job['id']}[/bold] ({_state(job['state'])})")
        if follow:
            _exit_with(follow_job(client, job["id"]))


@app.command()
def jobs(
    state: Annotated[list[str] | None, typer.Option(help="Only jobs in this state (repeatable).")] = None,
    limit: Annotated[int, typer.Option(help="How many, newest first.")] = 50,
    server: ServerOption = "http://127.0.0.1:8080",
) -> None:
    """List jobs."""
    page = _request(server, lambda client: client.jobs(states=state, limit=limit))
    # At 80 columns the cells that identify a job (id, state, progress, its metric) are never cut; the reason
    # takes what is left, with an ellipsis.
    # Newest first; `kembed status` has the times. The id, state, progress and metric are never cut; the reason
    # gets the rest of the line (an ellipsis where it is longer).
    rows = [
        [job["id"], job["state"], f"{job['progress']['step']}/{job['progress']['total_steps']}", _job_metric(job),
         job["reason"]]
        for job in page["items"]
    ]
    headers = ["ID", "STATE", "PROGRESS", "METRIC", "REASON"]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    room = max(len("REASON"), console.width - sum(widths[:-1]) - 2 * (len(headers) - 1))
    table = Table(*(Column(h, no_wrap=True) for h in headers), box=None, pad_edge=False)
    for row in rows:
        reason = row[-1] if len(row[-1]) <= room else row[-1][: room - 1] + "…"
        table.add_row(*row[:1], _state(row[1]), *row[2:-1], reason)
    console.print(table)


def _job_metric(job: dict[str, Any]) -> str:
    """The one metric that fits the job's kind (its `evaluation.metric: auto`: rmse for ratings, analogy accuracy
    with analogies, else auc); the result's once it finished, else the latest eval's."""
    try:
        trainer = config.TrainerConfig.model_validate(job["spec"]["trainer"])
        name = trainer.model.auto_metric(trainer)
    except config.ValidationError:  # stored before a rule of today: its metrics are still shown, as clicks'
        name = "auc"
    value = (job["result"] or {}).get(name, job["metrics"].get(f"eval_{name}"))
    label = "analogy" if name == "analogy_accuracy" else name
    return f"{label} {value:.4f}" if isinstance(value, int | float) else "-"


_EXPORT_SUFFIXES = kinds.EXPORT_FORMATS


@app.command()
def export(
    job_id: str,
    format: Annotated[str, typer.Option("--format", "-f", help=f"{kinds.in_words(tuple(_EXPORT_SUFFIXES))}.")]  # noqa: A002
    = "parquet",
    table: Annotated[str | None, typer.Option(help=kinds.DEFAULT_TABLE_HELP)] = None,
    step: Annotated[int | None, typer.Option(help="A complete checkpoint's step; default the latest.")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Default: <job>-<table>-step-N.<ext>.")]
    = None,
    server: ServerOption = "http://127.0.0.1:8080",
) -> None:
    """Download a job's embeddings from a complete checkpoint (any state, as soon as one is saved)."""
    if format not in _EXPORT_SUFFIXES:
        _fail(ValueError(f"--format: one of {', '.join(_EXPORT_SUFFIXES)}"))
    # Downloaded beside the target under a hidden name, renamed once whole: no half file under the real name.
    partial = (output.parent if output else Path()) / f".{job_id}.export.partial"
    columns = (TextColumn("[bold]export"), BarColumn(), TextColumn("{task.fields[mb]}"), TimeElapsedColumn())
    try:
        with _client(server) as client, open(partial, "wb") as out, Progress(*columns, console=console) as bar:
            task = bar.add_task(job_id, total=None, mb="")

            def progress(received: int, total: int) -> None:
                bar.update(task, completed=received, total=total or None,
                           mb=f"{received / 2**20:,.1f}/{total / 2**20:,.1f} MiB")

            sent = client.export(job_id, out, fmt=format, table=table, step=step, on_progress=progress)
    except ApiError as error:
        partial.unlink(missing_ok=True)
        _fail(error)
    target = output or Path(sent["filename"] or f"{job_id}{_EXPORT_SUFFIXES[format]}")
    partial.replace(target)
    console.print(f"wrote {target} (table {sent['table']}, checkpoint step {sent['step']}, "
                  f"{target.stat().st_size:,} bytes)")


@app.command()
def neighbours(
    job_id: str,
    word: str,
    k: Annotated[int, typer.Option("-k", help="How many.")] = 10,
    table: Annotated[str | None, typer.Option(help=kinds.DEFAULT_TABLE_HELP)] = None,
    server: ServerOption = "http://127.0.0.1:8080",
) -> None:
    """The nearest words (or ids) to WORD by cosine similarity, from the job's latest checkpoint."""
    found = _request(server, lambda client: client.neighbours(job_id, word, k=k, table=table))
    result = Table("KEY", "COSINE", title=f"{word!r} in {found['table']} (checkpoint step {found['checkpoint_step']})")
    for neighbour in found["neighbours"]:
        result.add_row(neighbour["key"], f"{neighbour['similarity']:.4f}")
    console.print(result)


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "-"


@app.command()
def status(job_id: str, server: ServerOption = "http://127.0.0.1:8080") -> None:
    """Show one job: state, progress, metrics, checkpoint and its events."""
    job = _request(server, lambda client: client.job(job_id))
    progress = job["progress"]
    console.print(f"[bold]{job['id']}[/bold]  {_state(job['state'])}  {job['reason']}: {job['message']}")
    console.print(f"progress   {progress['step']}/{progress['total_steps']} steps ({progress['fraction']:.0%})")
    if job["queue_position"]:
        console.print(f"queue      position {job['queue_position']}")
    if job["metrics"]:
        console.print("metrics    " + ", ".join(f"{k}={_fmt(v) if isinstance(v, float) else v}"
                                                for k, v in job["metrics"].items()))
    if job["result"]:
        console.print("result     " + ", ".join(f"{k}={_fmt(v)}" for k, v in job["result"].items()))
    if job.get("dataset"):
        console.print("dataset    " + ", ".join(f"{k}={v:,}" for k, v in job["dataset"].items()))
    console.print(f"checkpoint {job['checkpoint'] or '-'}")
    events = Table("TIME", "STATE", "REASON", "MESSAGE", title="events")
    for event in job["events"]:
        events.add_row(event["time"][:19].replace("T", " "), _state(event["state"]), event["reason"],
                       event["message"])
    console.print(events)


@app.command()
def cancel(job_id: str, server: ServerOption = "http://127.0.0.1:8080") -> None:
    """Cancel a job; a running one saves a checkpoint before it stops."""
    job = _request(server, lambda client: client.cancel(job_id))
    console.print(f"{job['id']}: {_state(job['state'])}" + (" (stopping)" if job["state"] not in TERMINAL else ""))


@app.command()
def logs(
    job_id: str,
    tail: Annotated[int | None, typer.Option(help="Only the last N lines of each node.")] = None,
    server: ServerOption = "http://127.0.0.1:8080",
) -> None:
    """Print a job's trainer logs."""
    sys.stdout.write(_request(server, lambda client: client.logs(job_id, tail=tail)))


# ----------------------------------------------------------------------------------------------- tenants
tenants_app = typer.Typer(help="Tenants (teams), their quotas and usage; creating them needs a platform admin.",
                          no_args_is_help=True)
tokens_app = typer.Typer(help="API tokens of a tenant (tenant admins and platform admins).", no_args_is_help=True)
app.add_typer(tenants_app, name="tenants")
app.add_typer(tokens_app, name="tokens")

GpusOption = Annotated[int | None, typer.Option(help="GPUs the tenant's running jobs may hold.")]
CpuOption = Annotated[float | None, typer.Option(help="CPU cores the tenant's running jobs may hold.")]
MemoryOption = Annotated[str | None, typer.Option(help="Memory the running jobs may hold, e.g. 256Gi.")]
RunningOption = Annotated[int | None, typer.Option(help="Jobs running at once.")]
QueuedOption = Annotated[int | None, typer.Option(help="Jobs waiting at once (more are refused).")]
CohortOption = Annotated[str | None, typer.Option(help="Cohort whose members lend each other idle quota.")]
BorrowGpusOption = Annotated[int | None, typer.Option(help="GPUs it may borrow beyond its quota (default: any idle).")]
ClassOption = Annotated[str | None, typer.Option(help="Highest priority class its jobs may use (default: any).")]
LimitOption = Annotated[list[str] | None, typer.Option(
    "--limit", help="Any quota field as NAME=VALUE, e.g. storage=2Ti or max_run_seconds=86400 (docs/api.md lists "
    "them; VALUE none: unlimited); repeat for more. The server checks the names and values.")]


def _sharing(cohort, borrow_gpus, max_priority_class) -> dict[str, Any] | None:
    """None when no sharing option is given (unchanged on set-quota; no cohort on create)."""
    if cohort is None and borrow_gpus is None and max_priority_class is None:
        return None
    borrowing = {"gpus": borrow_gpus} if borrow_gpus is not None else {}
    return {"cohort": cohort, "borrowing_limit": borrowing, "max_priority_class": max_priority_class}
ReadPrefixOption = Annotated[list[str] | None, typer.Option(
    "--read-prefix", help="A URI prefix (file://, s3:// or an absolute path) the tenant's jobs may read; repeat "
    "for more. Omitted on create: the platform's defaults.")]
WritePrefixOption = Annotated[list[str] | None, typer.Option(
    "--write-prefix", help="A URI prefix the tenant's jobs may write and read; repeat for more.")]


def _quota(gpus, cpu, memory, max_running_jobs, max_queued_jobs, limits: list[str] | None = None) -> dict[str, Any]:
    """Only the limits given (the server fills in or keeps the rest)."""
    given = {"gpus": gpus, "cpu": cpu, "memory": memory, "max_running_jobs": max_running_jobs,
             "max_queued_jobs": max_queued_jobs}
    quota = {k: v for k, v in given.items() if v is not None}
    for item in limits or []:
        name, _, value = item.partition("=")
        quota[name.strip()] = _limit_value(value.strip())
    return quota


def _limit_value(text: str) -> Any:
    """A --limit value as JSON would carry it: none/null, a whole number, a number, else the text (a quantity)."""
    if text.lower() in ("none", "null", ""):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def _show_quota(quota: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in quota.items() if v is not None) or "unlimited"


def _show_tenant(tenant: dict[str, Any]) -> None:
    console.print(f"tenant [bold]{tenant['name']}[/bold]: {_show_quota(tenant['quota'])}{_show_sharing(tenant)}")
    storage = tenant.get("storage")
    if storage:
        console.print(f"  storage: own folder {storage['own']}; read {', '.join(storage['read']) or '-'}; "
                      f"write {', '.join(storage['write']) or '-'}")


def _show_sharing(tenant: dict[str, Any]) -> str:
    sharing = tenant.get("sharing") or {}
    parts = []
    if sharing.get("cohort"):
        parts.append(f"cohort {sharing['cohort']}, may borrow {_show_quota(sharing.get('borrowing_limit') or {})}")
    if sharing.get("max_priority_class"):
        parts.append(f"priority classes up to {sharing['max_priority_class']}")
    return f"; {'; '.join(parts)}" if parts else ""


@tenants_app.command("create")
def tenants_create(name: str, gpus: GpusOption = None, cpu: CpuOption = None, memory: MemoryOption = None,
                   max_running_jobs: RunningOption = None, max_queued_jobs: QueuedOption = None,
                   limit: LimitOption = None, cohort: CohortOption = None, borrow_gpus: BorrowGpusOption = None,
                   max_priority_class: ClassOption = None, read_prefix: ReadPrefixOption = None,
                   write_prefix: WritePrefixOption = None, server: ServerOption = "http://127.0.0.1:8080") -> None:
    """Create a tenant; limits not given come from the platform's default quota (KEMBED_DEFAULT_QUOTA: a queue
    bound, otherwise unlimited; its quota is its guaranteed share in a cohort); a storage policy not given is the
    platform's default."""
    quota = _quota(gpus, cpu, memory, max_running_jobs, max_queued_jobs, limit)
    sharing = _sharing(cohort, borrow_gpus, max_priority_class)
    storage = ({"read": read_prefix or [], "write": write_prefix or []}
               if read_prefix is not None or write_prefix is not None else None)
    _show_tenant(_request(server, lambda client: client.create_tenant(name, quota, sharing, storage=storage)))


@tenants_app.command("set-storage")
def tenants_set_storage(name: str, read_prefix: ReadPrefixOption = None, write_prefix: WritePrefixOption = None,
                        server: ServerOption = "http://127.0.0.1:8080") -> None:
    """Replace a tenant's storage policy (prefixes not given are dropped); its own checkpoint folder is always
    allowed. Applies to jobs submitted and started from now on."""
    storage = {"read": read_prefix or [], "write": write_prefix or []}
    _show_tenant(_request(server, lambda client: client.set_storage(name, storage)))


@tenants_app.command("show")
def tenants_show(name: str, server: ServerOption = "http://127.0.0.1:8080") -> None:
    """One tenant: its quota and storage policy."""
    _show_tenant(_request(server, lambda client: client.tenant(name)))


@tenants_app.command("set-quota")
def tenants_set_quota(name: str, gpus: GpusOption = None, cpu: CpuOption = None, memory: MemoryOption = None,
                      max_running_jobs: RunningOption = None, max_queued_jobs: QueuedOption = None,
                      limit: LimitOption = None, cohort: CohortOption = None, borrow_gpus: BorrowGpusOption = None,
                      max_priority_class: ClassOption = None,
                      server: ServerOption = "http://127.0.0.1:8080") -> None:
    """Change the limits given of a tenant's quota (the others stay as they are) and, if any sharing option is
    given, replace its sharing; running jobs keep running."""
    quota = _quota(gpus, cpu, memory, max_running_jobs, max_queued_jobs, limit)
    sharing = _sharing(cohort, borrow_gpus, max_priority_class)
    _show_tenant(_request(server, lambda client: client.set_quota(name, quota, sharing)))


@tenants_app.command("list")
def tenants_list(server: ServerOption = "http://127.0.0.1:8080") -> None:
    """All tenants and their quotas."""
    items = _request(server, lambda client: client.tenants()["items"])
    table = Table("TENANT", "QUOTA", "CREATED")
    for tenant in items:
        table.add_row(tenant["name"], _show_quota(tenant["quota"]), tenant["created_at"][:19].replace("T", " "))
    console.print(table)


@tenants_app.command("usage")
def tenants_usage(name: Annotated[str | None, typer.Argument(help="Default: the token's own tenant.")] = None,
                  server: ServerOption = "http://127.0.0.1:8080") -> None:
    """A tenant's quota against what its jobs hold now, its queue and GPU-hours of the last 7 days."""
    usage = _request(server, lambda client: client.usage(name))
    used, quota = usage["used"], usage["quota"]
    console.print(f"[bold]{usage['tenant']}[/bold]  quota: {_show_quota(quota)}")
    console.print(f"used: {used['gpus']:g} GPUs, {used['cpu']:g} CPU, {used['memory_bytes'] / 2**30:.1f} GiB, "
                  f"{used['running_jobs']} running jobs; {usage['queued_jobs']} queued; "
                  f"{usage.get('stored_bytes', 0) / 2**30:.2f} GiB stored; {usage['gpu_hours_7d']:.1f} GPU-hours in 7 days")
    sharing = usage.get("sharing")
    if sharing:
        borrowed, lent = sharing["borrowed"], sharing["lent"]
        console.print(f"cohort {sharing['cohort']}: nominal {_show_quota(sharing['nominal'])}; borrowed "
                      f"{borrowed['gpus']:g} GPUs, {borrowed['cpu']:g} CPU; lent {lent['gpus']:g} GPUs, "
                      f"{lent['cpu']:g} CPU")


@tokens_app.command("create")
def tokens_create(tenant: str, name: Annotated[str, typer.Option(help="What the token is for.")],
                  role: Annotated[str, typer.Option(help="viewer, member, tenant-admin or platform-admin.")] = "member",
                  expires_at: Annotated[str | None, typer.Option(help="ISO time with zone, e.g. 2027-01-01T00:00:00Z.")]
                  = None, server: ServerOption = "http://127.0.0.1:8080") -> None:
    """Create a token; its secret is printed this once."""
    token = _request(server, lambda c: c.create_token(tenant, name=name, role=role, expires_at=expires_at))
    console.print(f"token {token['id']} ({token['role']}) for {tenant}; shown once, store it now:")
    print(token["token"])


@tokens_app.command("list")
def tokens_list(tenant: str, server: ServerOption = "http://127.0.0.1:8080") -> None:
    """A tenant's tokens (never their secrets)."""
    items = _request(server, lambda client: client.tokens(tenant)["items"])
    table = Table("ID", "NAME", "ROLE", "PREFIX", "EXPIRES", "REVOKED")
    for token in items:
        table.add_row(str(token["id"]), token["name"], token["role"], token["prefix"],
                      (token["expires_at"] or "-")[:19], (token["revoked_at"] or "-")[:19])
    console.print(table)


@tokens_app.command("revoke")
def tokens_revoke(tenant: str, token_id: int, server: ServerOption = "http://127.0.0.1:8080") -> None:
    """Revoke a token at once."""
    _request(server, lambda client: client.revoke_token(tenant, token_id))
    console.print(f"token {token_id} of {tenant} revoked")


# ----------------------------------------------------------------------------------------------- follow
def follow_job(client: Client, job_id: str, *, poll_s: float = 1.0) -> dict[str, Any]:
    """A live progress bar (step, loss, samples/s) and the job's events, until the job ends."""
    seen_events = 0
    columns = (
        TextColumn("[bold]{task.fields[state]:<10}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]} samples/s"), TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(job_id, total=None, state="QUEUED", loss="-", speed="-")
        while True:
            try:
                job = client.job(job_id)
            except ApiError as error:
                _fail(error)
            for event in job["events"][seen_events:]:
                bar.console.print(f"  {event['time'][11:19]}  {_state(event['state'], 10)} {event['reason']}: "
                                  f"{event['message']}")
            seen_events = len(job["events"])
            progress, metrics = job["progress"], job["metrics"]
            speed = metrics.get("samples_per_sec")
            bar.update(task, completed=progress["step"], total=progress["total_steps"] or None, state=job["state"],
                       loss=_fmt(metrics.get("loss")), speed=f"{speed:,.0f}" if speed else "-")
            if job["state"] in TERMINAL:
                break
            time.sleep(poll_s)
    _print_outcome(job)
    return job


def _print_outcome(job: dict[str, Any]) -> None:
    console.print(f"\nfinal state: {_state(job['state'])} ({job['reason']})")
    for name, value in (job["result"] or {}).items():
        console.print(f"eval {name}: [bold]{_fmt(value)}[/bold]")
    console.print(f"checkpoint: {job['checkpoint'] or '-'}")


def _exit_with(job: dict[str, Any]) -> None:
    raise typer.Exit(0 if job["state"] == JobState.SUCCEEDED else 1)


# ----------------------------------------------------------------------------------------------- demo
def _wait_healthy(client: Client, server: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            _fail(RuntimeError(f"the server exited with code {server.returncode}"))
        try:
            client.health()
            return
        except Exception:  # noqa: BLE001 (not up yet)
            time.sleep(0.3)
    _fail(TimeoutError(f"the server did not answer within {timeout_s:.0f}s"))


@app.command()
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
    _exit_with(job)


if __name__ == "__main__":
    app()
