"""A tiny MCP server over stdio (newline-delimited JSON-RPC), for an agent to run: one tool,
`ping`, which answers "pong" and appends each call's arguments to the file named by its
first argument, so a run can show that the model's call reached it.

    python mcp_echo.py CALLS_FILE
"""

from __future__ import annotations

import json
import sys

PING = {
    "name": "ping",
    "description": "Answers pong.",
    "inputSchema": {
        "type": "object",
        "properties": {"word": {"type": "string"}},
        "required": ["word"],
    },
}


def answer(request: dict, calls_file: str) -> dict | None:
    """The reply to one JSON-RPC message (None for a notification)."""
    method, params = request.get("method"), request.get("params") or {}
    if "id" not in request:
        return None
    if method == "initialize":
        result = {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "echo", "version": "1.0"},
        }
    elif method == "tools/list":
        result = {"tools": [PING]}
    elif method == "tools/call":
        with open(calls_file, "a") as calls:
            calls.write(json.dumps(params) + "\n")
        result = {"content": [{"type": "text", "text": "pong"}], "isError": False}
    else:
        error = {"code": -32601, "message": f"no method {method}"}
        return {"jsonrpc": "2.0", "id": request["id"], "error": error}
    return {"jsonrpc": "2.0", "id": request["id"], "result": result}


def main() -> None:
    calls_file = sys.argv[1]
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = answer(json.loads(line), calls_file)
        if reply is not None:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
