"""The API server on a background thread of this process, for in-process clients.

`mlxspec bench --concurrency` measures the real server (uvicorn, the worker thread, the
SSE stream) the way an editor meets it, without a second process that would have to
load the weights again; the tests use the same helper.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI


@contextmanager
def serving_in_thread(app: FastAPI, start_timeout: float = 10.0) -> Iterator[str]:
    """Run `app` on a free loopback port until the block ends; yields its base URL.

    On leaving, uvicorn shuts down gracefully (its lifespan stops the worker) and the
    thread is joined, so the next server starts on a quiet engine.
    """
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="mlxspec-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        if thread.is_alive():
            raise RuntimeError("the in-process server did not stop within 15 s")
