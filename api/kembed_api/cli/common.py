"""What every audience's commands share: the console, the server option, the token, one API call, states in colour."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console

from kembed_api.cli.client import ApiError, Client
from kembed_contract import lifecycle

# Also written by kembed_api.app; repeated here so the CLI's client commands don't import the server.
ADMIN_TOKEN_FILE = "admin-token"

__all__ = ["ADMIN_TOKEN_FILE", "STATE_STYLE", "TERMINAL", "ServerOption", "connect", "console", "fail", "fmt",
           "request", "styled_state", "token"]

# soft_wrap: long URIs and messages stay on one line, so they can be copied and grepped.
console = Console(soft_wrap=True)

ServerOption = Annotated[
    str, typer.Option("--server", envvar="KEMBED_SERVER", help="URL of the kembed API.")
]
TERMINAL = {state.value for state in lifecycle.TERMINAL_STATES}
_TONE_COLOUR = {lifecycle.Tone.ACTIVE: "cyan", lifecycle.Tone.TROUBLE: "yellow", lifecycle.Tone.STOPPED: "magenta",
                lifecycle.Tone.GOOD: "green", lifecycle.Tone.BAD: "red"}
STATE_STYLE = {state: _TONE_COLOUR.get(tone) for state, tone in lifecycle.STATE_TONES.items()}


def token() -> str | None:
    """KEMBED_TOKEN, else the admin token the embedded server wrote into its data dir (KEMBED_DATA_DIR)."""
    if os.environ.get("KEMBED_TOKEN"):
        return os.environ["KEMBED_TOKEN"]
    path = Path(os.environ.get("KEMBED_DATA_DIR", ".kembed")) / ADMIN_TOKEN_FILE
    return path.read_text().strip() if path.is_file() else None


def connect(server: str) -> Client:
    return Client(server, token=token())


def request(server: str, call: Callable[[Client], Any]) -> Any:
    """One API call; an API error ends the command with its message and exit code 1."""
    with connect(server) as client:
        try:
            return call(client)
        except ApiError as error:
            fail(error)
        except httpx.TransportError as error:
            fail(RuntimeError(f"cannot reach the kembed API at {server} ({error}); is `kembed serve` running?"))


def fail(error: ApiError | Exception) -> None:
    console.print(f"[red]error:[/red] {error}")
    raise typer.Exit(1)


def styled_state(state: str, width: int = 0) -> str:
    """The state coloured, padded to `width` before the markup so columns line up."""
    text, style = state.ljust(width), STATE_STYLE.get(state)
    return f"[{style}]{text}[/{style}]" if style else text


def fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "-"

