"""`kembed`: the command line, one module per audience.

`server`: whoever runs kembed (serve the embedded default, migrate, the demo). `jobs`: ML engineers (submit,
follow, cancel, logs, export). `admin`: platform and tenant admins (tenants, quotas, storage, tokens). `client`
is the HTTP client all of them (and tests, and scripts) call the API with.
"""

from __future__ import annotations

import typer

from kembed_api.cli import admin, jobs, server

__all__ = ["app"]

app = typer.Typer(help="kembed: training-as-a-service for sparse-embedding models.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
for command in (server.serve, server.migrate, jobs.submit, jobs.jobs, jobs.export, jobs.neighbours, jobs.status,
                jobs.cancel, jobs.logs, server.demo):
    app.command()(command)
app.add_typer(admin.tenants_app, name="tenants")
app.add_typer(admin.tokens_app, name="tokens")
