"""Free TCP ports on 127.0.0.1 (the demo server, local rendezvous)."""

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it; another process may still take it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
