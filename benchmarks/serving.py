"""`mlxspec serve` as a process of its own on a free loopback port, for the benchmarks that
drive the real server from outside (soak.py, agents/run.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_serve(extra_args: str = "", wait_seconds: int = 600) -> tuple[subprocess.Popen, str]:
    """(the serve process, its base URL), once /health names the model it loaded."""
    port = free_port()
    command = [sys.executable, "-m", "mlxspec", "serve", "--port", str(port)]
    serve = subprocess.Popen([*command, *extra_args.split()])
    url = f"http://127.0.0.1:{port}"
    for _ in range(wait_seconds):
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("model"):
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return serve, url
