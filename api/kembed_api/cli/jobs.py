"""What ML engineers run: submit, list, follow and cancel jobs, read their logs and take their embeddings out."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from kembed_api.cli.client import ApiError, Client
from kembed_api.cli.common import (
    TERMINAL,
    ServerOption,
    connect,
    console,
    fail,
    fmt,
    request,
    styled_state,
)
from kembed_contract import job_seconds, kinds, runtime
from kembed_contract import trainer_config as config
from kembed_contract.lifecycle import JobState

__all__ = ["cancel", "exit_with", "export", "follow_job", "jobs", "logs", "neighbours", "status", "submit"]


def _load_spec(path: Path) -> dict[str, Any]:
    try:
        spec = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        fail(error)
    if not isinstance(spec, dict):
        fail(ValueError(f"{path}: expected a YAML mapping (a job spec)"))
    return spec


def submit(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Job spec (YAML or JSON).")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Show live progress until the job ends.")] = False,
    server: ServerOption = "http://127.0.0.1:8080",
) -> None:
    """Submit a job."""
    with connect(server) as client:
        try:
            job = client.submit(_load_spec(file))
        except ApiError as error:
            fail(error)
        console.print(f"submitted [bold]{job['id']}[/bold] ({styled_state(job['state'])})")
        if follow:
            exit_with(follow_job(client, job["id"]))


def jobs(
    state: Annotated[list[str] | None, typer.Option(help="Only jobs in this state (repeatable).")] = None,
    limit: Annotated[int, typer.Option(help="How many, newest first.")] = 50,
    server: ServerOption = "http://127.0.0.1:8080",
) -> None:
    """List jobs."""
    page = request(server, lambda client: client.jobs(states=state, limit=limit))
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
        table.add_row(*row[:1], styled_state(row[1]), *row[2:-1], reason)
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
        fail(ValueError(f"--format: one of {', '.join(_EXPORT_SUFFIXES)}"))
    # Downloaded beside the target under a hidden name, renamed once whole: no half file under the real name.
    partial = (output.parent if output else Path()) / f".{job_id}.export.partial"
    columns = (TextColumn("[bold]export"), BarColumn(), TextColumn("{task.fields[mb]}"), TimeElapsedColumn())
    try:
        with connect(server) as client, open(partial, "wb") as out, Progress(*columns, console=console) as bar:
            task = bar.add_task(job_id, total=None, mb="")

            def progress(received: int, total: int) -> None:
                bar.update(task, completed=received, total=total or None,
                           mb=f"{received / 2**20:,.1f}/{total / 2**20:,.1f} MiB")

            sent = client.export(job_id, out, fmt=format, table=table, step=step, on_progress=progress)
    except ApiError as error:
        partial.unlink(missing_ok=True)
        fail(error)
    target = output or Path(sent["filename"] or f"{job_id}{_EXPORT_SUFFIXES[format]}")
    partial.replace(target)
    console.print(f"wrote {target} (table {sent['table']}, checkpoint step {sent['step']}, "
                  f"{target.stat().st_size:,} bytes)")


def neighbours(
    job_id: str,
    word: str,
    k: Annotated[int, typer.Option("-k", help="How many.")] = 10,
    table: Annotated[str | None, typer.Option(help=kinds.DEFAULT_TABLE_HELP)] = None,
    server: ServerOption = "http://127.0.0.1:8080",
) -> None:
    """The nearest words (or ids) to WORD by cosine similarity, from the job's latest checkpoint."""
    found = request(server, lambda client: client.neighbours(job_id, word, k=k, table=table))
    result = Table("KEY", "COSINE", title=f"{word!r} in {found['table']} (checkpoint step {found['checkpoint_step']})")
    for neighbour in found["neighbours"]:
        result.add_row(neighbour["key"], f"{neighbour['similarity']:.4f}")
    console.print(result)


def dynamic_tables_line(metrics: dict) -> str | None:
    """The latest eval's report of the job's dynamic tables (runtime.DYNAMIC_TABLE_METRICS), as one line; None
    for a job without them."""
    values = {key: metrics.get(f"eval_{key}") for key in runtime.DYNAMIC_TABLE_METRICS}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values.values()):
        return None
    (in_use, *since) = [f"{label} {values[key]:,}" for key, label in runtime.DYNAMIC_TABLE_METRICS.items()]
    return f"dynamic    {in_use}; since the eval before: {', '.join(since)}"


def seconds_line(seconds: dict[str, float]) -> str:
    """`seconds    41.2 s: queued 0.1, process start 3.0, ...`: where the job's wall time went, every phase shown
    (a zero too: that a phase took nothing is news), in the contract's order."""
    phases = ", ".join(f"{label} {seconds.get(phase, 0.0):.1f}" for phase, label in job_seconds.PHASE_LABELS.items())
    return f"seconds    {seconds['wall']:.1f} s: {phases}"


def status(job_id: str, server: ServerOption = "http://127.0.0.1:8080") -> None:
    """Show one job: state, progress, metrics, checkpoint and its events."""
    job = request(server, lambda client: client.job(job_id))
    progress = job["progress"]
    console.print(f"[bold]{job['id']}[/bold]  {styled_state(job['state'])}  {job['reason']}: {job['message']}")
    console.print(f"progress   {progress['step']}/{progress['total_steps']} steps ({progress['fraction']:.0%})")
    if job["queue_position"]:
        console.print(f"queue      position {job['queue_position']}")
    metrics = {k: v for k, v in job["metrics"].items() if k.removeprefix("eval_") not in runtime.DYNAMIC_TABLE_METRICS}
    if metrics:
        console.print("metrics    " + ", ".join(f"{k}={fmt(v) if isinstance(v, float) else v}"
                                                for k, v in metrics.items()))
    if line := dynamic_tables_line(job["metrics"]):
        console.print(line)
    result = {k: v for k, v in (job["result"] or {}).items() if k not in runtime.DYNAMIC_TABLE_METRICS}
    if result:
        console.print("result     " + ", ".join(f"{k}={fmt(v)}" for k, v in result.items()))
    if job.get("dataset"):
        console.print("dataset    " + ", ".join(f"{k}={v:,}" for k, v in job["dataset"].items()))
    if job.get("seconds"):
        console.print(seconds_line(job["seconds"]))
    console.print(f"latest checkpoint {job['latest_checkpoint_uri'] or '-'}")
    events = Table("TIME", "STATE", "REASON", "MESSAGE", title="events")
    for event in job["events"]:
        events.add_row(event["time"][:19].replace("T", " "), styled_state(event["state"]), event["reason"],
                       event["message"])
    console.print(events)


def cancel(job_id: str, server: ServerOption = "http://127.0.0.1:8080") -> None:
    """Cancel a job; a running one saves a checkpoint before it stops."""
    job = request(server, lambda client: client.cancel(job_id))
    console.print(f"{job['id']}: {styled_state(job['state'])}" + (" (stopping)" if job["state"] not in TERMINAL else ""))


def logs(
    job_id: str,
    tail: Annotated[int | None, typer.Option(help="Only the last N lines of each node.")] = None,
    server: ServerOption = "http://127.0.0.1:8080",
) -> None:
    """Print a job's trainer logs."""
    sys.stdout.write(request(server, lambda client: client.logs(job_id, tail=tail)))



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
                fail(error)
            for event in job["events"][seen_events:]:
                bar.console.print(f"  {event['time'][11:19]}  {styled_state(event['state'], 10)} {event['reason']}: "
                                  f"{event['message']}")
            seen_events = len(job["events"])
            progress, metrics = job["progress"], job["metrics"]
            speed = metrics.get("samples_per_sec")
            bar.update(task, completed=progress["step"], total=progress["total_steps"] or None, state=job["state"],
                       loss=fmt(metrics.get("loss")), speed=f"{speed:,.0f}" if speed else "-")
            if job["state"] in TERMINAL:
                break
            time.sleep(poll_s)
    _print_outcome(job)
    return job


def _print_outcome(job: dict[str, Any]) -> None:
    console.print(f"\nfinal state: {styled_state(job['state'])} ({job['reason']})")
    for name, value in (job["result"] or {}).items():
        console.print(f"eval {name}: [bold]{fmt(value)}[/bold]")
    console.print(f"latest checkpoint: {job['latest_checkpoint_uri'] or '-'}")


def exit_with(job: dict[str, Any]) -> None:
    raise typer.Exit(0 if job["state"] == JobState.SUCCEEDED else 1)
