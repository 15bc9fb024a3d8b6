"""The server's listening socket, bound before anything slow happens.

Binding first means a busy port (a second `mlxspec serve`, say) fails with one line in a
moment, before the model loads and before "serving ..." is printed; uvicorn then serves
on this very socket, so no other process can take the port in between.
"""

from __future__ import annotations

import errno
import socket


class ListenError(OSError):
    """The address cannot be listened on: one line for the user."""


def bind_listening_socket(host: str, port: int) -> socket.socket:
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ListenError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    family, kind, proto, _, address = found[0]
    sock = socket.socket(family, kind, proto)
    # As uvicorn does: a port left in TIME_WAIT by a server that just stopped is free.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        reason = err.strerror or str(err)
        advice = "; pick another with --port" if err.errno == errno.EADDRINUSE else ""
        raise ListenError(f"cannot listen on {host}:{port}: {reason}{advice}") from None
    sock.set_inheritable(True)
    return sock
