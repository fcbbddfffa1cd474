"""Local TCP ports: the one place the server launcher, the tensor-parallel executor (its
TCPStore) and the tests pick a free port."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
