"""What platform and tenant admins run: tenants, their quotas, storage and usage, and API tokens."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from kembed_api.cli.common import (
    ServerOption,
    console,
    request,
)

__all__ = ["tenants_app", "tokens_app"]


tenants_app = typer.Typer(help="Tenants (teams), their quotas and usage; creating them needs a platform admin.",
                          no_args_is_help=True)
tokens_app = typer.Typer(help="API tokens of a tenant (tenant admins and platform admins).", no_args_is_help=True)

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
    _show_tenant(request(server, lambda client: client.create_tenant(name, quota, sharing, storage=storage)))


@tenants_app.command("set-storage")
def tenants_set_storage(name: str, read_prefix: ReadPrefixOption = None, write_prefix: WritePrefixOption = None,
                        server: ServerOption = "http://127.0.0.1:8080") -> None:
    """Replace a tenant's storage policy (prefixes not given are dropped); its own checkpoint folder is always
    allowed. Applies to jobs submitted and started from now on."""
    storage = {"read": read_prefix or [], "write": write_prefix or []}
    _show_tenant(request(server, lambda client: client.set_storage(name, storage)))


@tenants_app.command("show")
def tenants_show(name: str, server: ServerOption = "http://127.0.0.1:8080") -> None:
    """One tenant: its quota and storage policy."""
    _show_tenant(request(server, lambda client: client.tenant(name)))


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
    _show_tenant(request(server, lambda client: client.set_quota(name, quota, sharing)))


@tenants_app.command("list")
def tenants_list(server: ServerOption = "http://127.0.0.1:8080") -> None:
    """All tenants and their quotas."""
    items = request(server, lambda client: client.tenants()["items"])
    table = Table("TENANT", "QUOTA", "CREATED")
    for tenant in items:
        table.add_row(tenant["name"], _show_quota(tenant["quota"]), tenant["created_at"][:19].replace("T", " "))
    console.print(table)


@tenants_app.command("usage")
def tenants_usage(name: Annotated[str | None, typer.Argument(help="Default: the token's own tenant.")] = None,
                  server: ServerOption = "http://127.0.0.1:8080") -> None:
    """A tenant's quota against what its jobs hold now, its queue and GPU-hours of the last 7 days."""
    usage = request(server, lambda client: client.usage(name))
    used, quota = usage["used"], usage["quota"]
    console.print(f"[bold]{usage['tenant']}[/bold]  quota: {_show_quota(quota)}")
    from kembed_contract.quota import QuotaSpec  # pydantic: only where needed, the CLI starts without it

    # Each dimension of the quota something is measured against (kembed_contract.quota): what running jobs hold is
    # under `used`, the rest (queued jobs, bytes stored) is counted beside it.
    shown = [d.in_words((used if d.held else usage).get(d.used, 0)) for d in QuotaSpec.dimensions() if d.used]
    console.print(f"used: {', '.join(shown)}; {usage['gpu_hours_7d']:.1f} GPU-hours in 7 days")
    sharing = usage.get("sharing")
    if sharing:
        def held(amounts: dict[str, Any]) -> str:
            return ", ".join(d.in_words(amounts.get(d.used, 0)) for d in QuotaSpec.held())
        console.print(f"cohort {sharing['cohort']}: nominal {_show_quota(sharing['nominal'])}; borrowed "
                      f"{held(sharing['borrowed'])}; lent {held(sharing['lent'])}")


@tokens_app.command("create")
def tokens_create(tenant: str, name: Annotated[str, typer.Option(help="What the token is for.")],
                  role: Annotated[str, typer.Option(help="viewer, member, tenant-admin or platform-admin.")] = "member",
                  expires_at: Annotated[str | None, typer.Option(help="ISO time with zone, e.g. 2027-01-01T00:00:00Z.")]
                  = None, server: ServerOption = "http://127.0.0.1:8080") -> None:
    """Create a token; its secret is printed this once."""
    token = request(server, lambda c: c.create_token(tenant, name=name, role=role, expires_at=expires_at))
    console.print(f"token {token['id']} ({token['role']}) for {tenant}; shown once, store it now:")
    print(token["token"])


@tokens_app.command("list")
def tokens_list(tenant: str, server: ServerOption = "http://127.0.0.1:8080") -> None:
    """A tenant's tokens (never their secrets)."""
    items = request(server, lambda client: client.tokens(tenant)["items"])
    table = Table("ID", "NAME", "ROLE", "PREFIX", "EXPIRES", "REVOKED")
    for token in items:
        table.add_row(str(token["id"]), token["name"], token["role"], token["prefix"],
                      (token["expires_at"] or "-")[:19], (token["revoked_at"] or "-")[:19])
    console.print(table)


@tokens_app.command("revoke")
def tokens_revoke(tenant: str, token_id: int, server: ServerOption = "http://127.0.0.1:8080") -> None:
    """Revoke a token at once."""
    request(server, lambda client: client.revoke_token(tenant, token_id))
    console.print(f"token {token_id} of {tenant} revoked")
