"""Only the user reaches the server: `Host` and `Origin` checked at the edge, for every dialect.

A web page the user opens can send requests to 127.0.0.1. Two doors are shut here:
- DNS rebinding: a page whose own name now resolves to 127.0.0.1 is same-origin with the
  server, so the browser lets it read the answers; its requests still say `Host:
  attacker.example`. A request is served only when `Host` names the address the connection
  arrived at (or, on a loopback address, localhost/127.0.0.1/[::1]), on that port, or a
  name the user allowed (`--allowed-hosts`).
- Cross-origin requests: a browser sends `Origin` with every cross-origin POST; one from
  another origin than the server's own is refused unless the user allowed it
  (`--cors-origins`), and then Starlette's CORSMiddleware answers its preflights.
Clients that are not browsers (SDKs, curl, editors) send no `Origin` and a `Host` of the
address they dialled, so nothing changes for them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxspec.server.errors import ApiError, ErrorShape

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ANY = "*"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def unmapped(address: str) -> str:
    """An address as clients name it: an IPv4 client of a dual-stack socket (`--host ::`)
    arrives as ::ffff:127.0.0.1, and says 127.0.0.1."""
    address = address.lower().strip("[]")
    try:
        mapped = ipaddress.ip_address(address)
    except ValueError:
        return address
    ipv4 = getattr(mapped, "ipv4_mapped", None)
    return str(ipv4) if ipv4 is not None else address


def split_host(authority: str) -> tuple[str, int | None]:
    """'Example.org:8000' -> ('example.org', 8000); '[::1]:80' -> ('::1', 80); a port that
    is not a number -> port -1 (matches nothing)."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        name, _, rest = authority[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif authority.count(":") == 1:
        name, _, port_text = authority.partition(":")
    else:  # a bare name, or an IPv6 address without brackets
        name, port_text = authority, ""
    if not port_text:
        return name, None
    return name, int(port_text) if port_text.isdigit() else -1


class OriginGuard:
    """ASGI middleware: 403 for a `Host` or an `Origin` the user did not allow.

    `allowed_hosts`: names (any port) served besides the server's own address; `*`: any.
    `cors_origins`: origins ('http://localhost:3000') a browser page may call from; `*`: any.
    `shape(path)`: the error shape of the dialect that owns `path` (None: OpenAI's).
    """

    def __init__(
        self,
        app: ASGIApp,
        allowed_hosts: Sequence[str] = (),
        cors_origins: Sequence[str] = (),
        shape: Callable[[str], ErrorShape | None] = lambda path: None,
    ):
        self.allowed_hosts = {host.strip().lower().strip("[]") for host in allowed_hosts}
        self.cors_origins = {origin.strip().rstrip("/").lower() for origin in cors_origins}
        self.shape = shape
        if self.cors_origins:
            app = CORSMiddleware(
                app,
                allow_origins=sorted(self.cors_origins),
                allow_methods=["*"],
                allow_headers=["*"],
                expose_headers=["*"],
            )
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
        }
        host = headers.get("host", "")
        reason = None
        if not self.host_allowed(host, scope.get("server")):
            reason = (
                f"Host {host!r} is not this server's address; a client that reaches it by "
                "that name needs `mlxspec serve --allowed-hosts` to name it"
            )
        elif "origin" in headers and not self.origin_allowed(headers["origin"], host):
            reason = (
                f"Origin {headers['origin']!r} is not this server's; a web page served from "
                "it may call this server only when `mlxspec serve --cors-origins` names it"
            )
        if reason is None:
            return await self.app(scope, receive, send)
        refusal = ApiError(403, reason, code="forbidden_origin", type="permission_error")
        return await refusal.response(self.shape(scope.get("path", "")))(scope, receive, send)

    def host_allowed(self, host: str, server: tuple[str, int | None] | None) -> bool:
        """`host` (the header) names the address the connection came to, or an allowed name."""
        if ANY in self.allowed_hosts:
            return True
        name, port = split_host(host)
        if name in self.allowed_hosts:
            return True
        if server is None:  # a Unix socket: only this machine can reach it
            return is_loopback(name)
        own_name, own_port = unmapped(server[0]), server[1]
        if (80 if port is None else port) != own_port:  # no port in Host: http's own
            return False
        return name == own_name or (is_loopback(own_name) and name in LOOPBACK_NAMES)

    def origin_allowed(self, origin: str, host: str) -> bool:
        """The page's origin is the server's own (same scheme-less authority) or allowed."""
        origin = origin.strip().rstrip("/").lower()
        if ANY in self.cors_origins or origin in self.cors_origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.netloc == host.strip().lower()
