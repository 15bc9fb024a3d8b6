"""A doorbell from rank 0 to the ranks that follow it, so that they wait for its next
announcement asleep instead of inside a collective.

MLX's ring backend waits for a peer by polling its socket without sleeping
(`mlx/distributed/ring/ring.cpp`, `SocketThread::worker`), so a follower waiting in a
collective for rank 0's next request takes a whole core for as long as the server or
chat is idle. Under `serve` and `chat` rank 0 now rings first (one byte on a plain TCP
connection to each follower), and a follower blocks in `recv` until the byte comes, then
joins the collective that carries the announcement, which rank 0 is already in.

One ring for every announcement, one wait for every one received, so they pair by
construction (`Collectives.announce` / `Collectives.await_announcement`). Where the
bell cannot be set up (no address to listen on, a firewall between hosts) every rank
goes on without it, as before.
"""

from __future__ import annotations

import contextlib
import socket

CONNECT_SECONDS = 10.0  # a follower's connection to rank 0's bell, and rank 0's accept


class Bell:
    """Rank 0's side: a connection to each follower. A follower's: its one connection."""

    def __init__(self, connections: list[socket.socket]):
        self.connections = connections
        for connection in connections:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def ring(self) -> None:
        """Rank 0, right before an announcement. A follower that is gone is found by the
        collective that follows, as without a bell."""
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.sendall(b"\x01")

    def wait(self) -> None:
        """A follower, before joining an announcement: sleep until rank 0 rang. A closed
        connection (rank 0 gone) returns at once from now on: the collective then says
        what happened."""
        try:
            rang = bool(self.connections) and self.connections[0].recv(1)
        except OSError:
            rang = False
        if not rang:
            self.close()

    def close(self) -> None:
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.close()
        self.connections = []


def listen(host: str) -> socket.socket | None:
    """Rank 0's listening socket on its ring address (any free port), or None."""
    try:
        return socket.create_server((host, 0), backlog=64)
    except OSError:
        return None


def connect(host: str, port: int) -> socket.socket | None:
    """A follower's connection to rank 0's bell, or None where it cannot be made."""
    try:
        connection = socket.create_connection((host, port), timeout=CONNECT_SECONDS)
    except OSError:
        return None
    connection.settimeout(None)  # `wait` blocks for as long as rank 0 is idle
    return connection


def accept(server: socket.socket, count: int) -> list[socket.socket] | None:
    """Rank 0: the followers' `count` connections (each already made, in the backlog),
    or None if one is missing."""
    server.settimeout(CONNECT_SECONDS)
    connections = []
    try:
        for _ in range(count):
            connection, _ = server.accept()
            connection.settimeout(None)
            connections.append(connection)
    except OSError:
        for connection in connections:
            connection.close()
        return None
    finally:
        server.close()
    return connections
