"""The coding agents people run, against `mlxspec serve`, for real (run before a release).

Installs pinned releases of six agent CLIs into a scratch folder (npm and PyPI), starts
`serve` (or uses --url), and runs each agent non-interactively twice:

- a one-word turn ("Reply with the single word: pong");
- a tool round trip, driven: the agents do not let a user set tool_choice, so the recording
  proxy between the agent and the server forces a call to the agent's shell tool on the
  turn's first request (tool_choice named, the tool's parameters narrowed to `echo pong`,
  so the command is known and harmless) and passes every later request as the agent sent
  it; the agent runs the command and sends its result back, which the model answers.
  `codex-mcp` is Codex with a tiny stdio MCP server (mcp_echo.py): its driven turn calls
  the server's `ping`, offered inside Codex's `mcp__echo` namespace; the server writes down
  each call it gets, so the table shows the model's call reaching it.

Every request goes through that proxy, which records method, path, status and body (with
--fixtures DIR, each agent's first request is written there: tests/data/agents/ is made
so). Telemetry, update checks and plugin fetches are turned off where the agent has a
switch, and any other outbound connection goes to a local proxy that logs and refuses it.
Writes a Markdown table (agent, version, wire API, requests and statuses, answer) to
stdout and, with --out, a JSON file.

    python benchmarks/agents/run.py --install /tmp/agents            # install, then run
    python benchmarks/agents/run.py --scratch /tmp/agents --only codex claude-code
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/serving.py
from serving import free_port, start_serve  # noqa: E402

from mlxspec.server.responses.translate import flat_name  # noqa: E402

PONG = "Reply with the single word: pong"
TOOL_TURN = "Run the shell command `echo pong` with your shell tool and tell me what it printed."
NPM = {
    "claude-code": ("@anthropic-ai/claude-code", "2.1.332"),
    "codex": ("@openai/codex", "0.171.0"),
    "qwen-code": ("@qwen-code/qwen-code", "0.24.4"),
    "opencode": ("opencode-ai", "1.18.33"),
    "continue-cli": ("@continuedev/cli", "1.5.47"),
}
AIDER = ("aider-chat", "0.86.2")
MODEL = "smollm2-135m"
MCP_CALLS = "mcp-calls.jsonl"  # what mcp_echo.py was called with, in the agent's home


# --- The two proxies --------------------------------------------------------------------


# opencode installs its provider SDK (@ai-sdk/openai-compatible) from npm on first use and
# will not start without it: the npm registry is the one host let through.
ALLOWED = {"registry.npmjs.org:443"}


class Refuser(ThreadingHTTPServer):
    """HTTP(S)_PROXY for the agents: logs where they tried to go, refuses it (the npm
    registry alone is tunnelled, for opencode's provider package)."""

    def __init__(self):
        self.tried: list[str] = []
        self.tunnelled: list[str] = []
        refuser = self

        class Handler(BaseHTTPRequestHandler):
            def _refuse(self):
                if self.command == "CONNECT" and self.path in ALLOWED:
                    refuser.tunnelled.append(self.path)
                    return self._tunnel()
                refuser.tried.append(f"{self.command} {self.path}")
                self.send_error(403, "outbound connections are refused in this run")

            def _tunnel(self):
                host, port = self.path.rsplit(":", 1)
                upstream = socket.create_connection((host, int(port)), timeout=30)
                self.send_response(200, "Connection established")
                self.end_headers()
                pipes = [(self.connection, upstream), (upstream, self.connection)]
                relays = [threading.Thread(target=_relay, args=pipe, daemon=True) for pipe in pipes]
                for relay in relays:
                    relay.start()
                for relay in relays:
                    relay.join()
                upstream.close()

            do_CONNECT = do_GET = do_POST = do_PUT = do_HEAD = _refuse

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", free_port()), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _relay(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@dataclass
class Drive:
    """Force the next first-of-a-turn request to call `tool` with `arguments`."""

    tool: str
    arguments: dict
    done: bool = False


@dataclass
class Recorder:
    """A reverse proxy in front of `serve`: records each request, drives a tool turn."""

    upstream: str
    requests: list[dict] = field(default_factory=list)
    drive: Drive | None = None

    def start(self) -> str:
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self):
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                driven = False
                if isinstance(body, dict) and recorder.drive and not recorder.drive.done:
                    driven = force_call(self.path, body, recorder.drive)
                    recorder.drive.done = driven
                    raw = json.dumps(body).encode()
                headers = {k: v for k, v in self.headers.items() if k.lower() in KEEP}
                started = time.monotonic()
                with httpx.Client(timeout=900) as client:
                    reply = client.request(
                        self.command, recorder.upstream + self.path, content=raw, headers=headers
                    )
                recorder.requests.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "status": reply.status_code,
                        "seconds": round(time.monotonic() - started, 1),
                        "driven": driven,
                        "headers": {k.lower(): v for k, v in self.headers.items()},
                        "body": body,
                        "error": reply.text[:300] if reply.status_code >= 400 else None,
                    }
                )
                self.send_response(reply.status_code)
                for key in ("content-type", "retry-after", "x-mlxspec-dropped-tools"):
                    if key in reply.headers:
                        self.send_header(key, reply.headers[key])
                self.send_header("content-length", str(len(reply.content)))
                self.end_headers()
                self.wfile.write(reply.content)

            do_GET = do_POST = do_DELETE = _forward

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}"


KEEP = {"content-type", "authorization", "x-api-key", "anthropic-version", "anthropic-beta"}


def _responses_tools(tool: dict) -> list[tuple[dict, str]]:
    """A Responses tool, or a namespace's tools, each with the name the model is offered."""
    if tool.get("type") == "namespace":
        return [(inner, flat_name(tool["name"], inner["name"])) for inner in tool["tools"]]
    return [(tool, tool.get("name"))]


def force_call(path: str, body: dict, drive: Drive) -> bool:
    """Rewrite a request so the model must call `drive.tool` with `drive.arguments`: the
    named tool_choice of the request's dialect, the tool's parameters narrowed to those
    values. False where the request has no such tool (a title request, say)."""
    schema = {
        "type": "object",
        "properties": {key: {"const": value} for key, value in drive.arguments.items()},
        "required": list(drive.arguments),
    }
    tools = body.get("tools") or []
    if path.startswith("/v1/messages"):
        for tool in tools:
            if tool.get("name") == drive.tool:
                tool["input_schema"] = schema
                body["tool_choice"] = {
                    "type": "tool",
                    "name": drive.tool,
                    "disable_parallel_tool_use": True,
                }
                return True
    elif path.startswith("/v1/responses"):
        for tool in tools:
            # a namespace's tool (an MCP server's) is chosen by the flat name it is offered by
            for inner, name in _responses_tools(tool):
                if inner.get("name") == drive.tool:
                    inner["parameters"] = schema
                    body["tool_choice"] = {"type": "function", "name": name}
                    body["parallel_tool_calls"] = False
                    return True
    elif path.startswith("/v1/chat/completions"):
        for tool in tools:
            if tool.get("function", {}).get("name") == drive.tool:
                tool["function"]["parameters"] = schema
                body["tool_choice"] = {"type": "function", "function": {"name": drive.tool}}
                return True
    return False


# --- The agents -------------------------------------------------------------------------


@dataclass(frozen=True)
class Agent:
    name: str
    wire: str
    shell_tool: str | None  # the tool a driven turn calls; None: the agent makes no calls
    shell_arguments: dict


AGENTS = [
    Agent("claude-code", "Anthropic Messages", "Bash", {"command": "echo pong"}),
    Agent("codex", "Responses", "exec_command", {"cmd": "echo pong"}),
    # Codex with a stdio MCP server (mcp_echo.py): its tool arrives inside a namespace
    Agent("codex-mcp", "Responses", "ping", {"word": "pong"}),
    Agent("qwen-code", "chat completions", "run_shell_command", {"command": "echo pong"}),
    Agent("opencode", "chat completions", "bash", {"command": "echo pong", "description": "echo"}),
    Agent("continue-cli", "chat completions", "Bash", {"command": "echo pong"}),
    Agent("aider", "chat completions", None, {}),
]


def command(agent: Agent, scratch: Path, base: str, home: Path, work: Path, prompt: str):
    """(argv, environment) that run `agent` once on `prompt` against `base`."""
    bin_dir = scratch / "node_modules" / ".bin"
    env = {"HOME": str(home), "MLXSPEC_API_KEY": "sk-local"}
    if agent.name == "claude-code":
        env |= {
            "ANTHROPIC_BASE_URL": base,
            "ANTHROPIC_API_KEY": "sk-local",
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
        }
        # Its own 15k-token system prompt and tools are over SmolLM2's 8k context: slimmed.
        argv = [str(bin_dir / "claude"), "-p", prompt, "--model", MODEL, "--output-format", "json"]
        argv += ["--system-prompt", "You are a helpful assistant. Be brief."]
        argv += ["--tools", "Bash", "--allowedTools", "Bash(echo:*)"]
        return argv, env
    if agent.name in ("codex", "codex-mcp"):
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        config = (
            f'model = "{MODEL}"\nmodel_provider = "mlxspec"\n'
            "check_for_update_on_startup = false\n\n[model_providers.mlxspec]\n"
            f'name = "mlxspec"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
            'env_key = "MLXSPEC_API_KEY"\n'
        )
        if agent.name == "codex-mcp":  # the server writes each call it gets to MCP_CALLS
            server = [str(Path(__file__).with_name("mcp_echo.py")), str(home / MCP_CALLS)]
            config += (
                f"\n[mcp_servers.echo]\ncommand = {json.dumps(sys.executable)}\n"
                f"args = {json.dumps(server)}\n"
                'default_tools_approval_mode = "approve"\n'  # `exec` asks no one
                # with its sub-agents and goals too, Codex's prompt is over SmolLM2's 8k
                "\n[features]\nmulti_agent = false\ngoals = false\n[agents]\nenabled = false\n"
            )
        (codex_home / "config.toml").write_text(config)
        env["CODEX_HOME"] = str(codex_home)
        argv = [str(bin_dir / "codex"), "exec", "--skip-git-repo-check"]
        argv += ["--output-last-message", str(home / "answer.txt"), prompt]
        return argv, env
    if agent.name == "qwen-code":
        settings = home / ".qwen"
        settings.mkdir(parents=True, exist_ok=True)
        # Its sub-agent, skill and goal tools alone are 6k tokens: removed (a whole-tool deny).
        extra_tools = ["agent", "list_agents", "skill", "tool_search", "tool_call"]
        extra_tools += ["get_goal", "update_goal"]
        settings_json = {
            "usageStatisticsEnabled": False,
            "permissions": {"deny": extra_tools},
            "skills": {"disabledLevels": ["bundled"]},  # its bundled skills' 2k-token list
        }
        (settings / "settings.json").write_text(json.dumps(settings_json))
        env |= {"OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": "sk-local"}
        env["OPENAI_MODEL"] = MODEL
        # Its 14k-token system prompt is over SmolLM2's 8k context: slimmed, as Claude Code's.
        argv = [str(bin_dir / "qwen"), "--auth-type", "openai", "--yolo", "-p", prompt]
        argv += ["--system-prompt", "You are a helpful assistant. Be brief."]
        argv += ["--core-tools", "run_shell_command"]
        return argv, env
    if agent.name == "opencode":
        provider = {
            "npm": "@ai-sdk/openai-compatible",
            "name": "mlxspec",
            "options": {"baseURL": f"{base}/v1", "apiKey": "sk-local"},
            "models": {MODEL: {"name": "SmolLM2 135M"}},
        }
        config = {
            "provider": {"mlxspec": provider},
            "model": f"mlxspec/{MODEL}",
            "small_model": f"mlxspec/{MODEL}",
            "autoupdate": False,
            "share": "disabled",
        }
        (work / "opencode.json").write_text(json.dumps(config))
        off = ("AUTOUPDATE", "MODELS_FETCH", "DEFAULT_PLUGINS", "LSP_DOWNLOAD", "SHARE")
        env |= {f"OPENCODE_DISABLE_{switch}": "1" for switch in off}
        return [str(bin_dir / "opencode"), "run", "--auto", prompt], env
    if agent.name == "continue-cli":
        config = home / "continue.yaml"
        config.write_text(
            "name: mlxspec\nversion: 1.0.0\nschema: v1\nmodels:\n  - name: SmolLM2\n"
            f"    provider: openai\n    model: {MODEL}\n    apiBase: {base}/v1\n"
            "    apiKey: sk-local\n    roles: [chat, edit, apply]\n"
        )
        argv = [str(bin_dir / "cn"), "--config", str(config), "--auto", "-p", prompt]
        return argv, env
    if agent.name == "aider":
        env |= {"OPENAI_API_BASE": f"{base}/v1", "OPENAI_API_KEY": "sk-local"}
        argv = [str(scratch / "aider-venv" / "bin" / "aider"), "--model", f"openai/{MODEL}"]
        argv += ["--no-git", "--no-check-update", "--analytics-disable", "--no-show-model-warnings"]
        argv += ["--yes-always", "--no-stream", "--message", prompt]
        return argv, env
    raise ValueError(agent.name)


def install(scratch: Path) -> None:
    scratch.mkdir(parents=True, exist_ok=True)
    packages = [f"{name}@{version}" for name, version in NPM.values()]
    subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(scratch), *packages],
        check=True,
    )
    venv = scratch / "aider-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", f"{AIDER[0]}=={AIDER[1]}"], check=True
    )


def version_of(agent: Agent) -> str:
    return AIDER[1] if agent.name == "aider" else NPM[agent.name.removesuffix("-mcp")][1]


def run_turn(
    agent: Agent,
    scratch: Path,
    recorder: Recorder,
    base: str,
    refuser: Refuser,
    prompt: str,
    drive: Drive | None,
    timeout: float,
) -> dict:
    home = scratch / "homes" / agent.name
    work = scratch / "work" / agent.name
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    home.mkdir(parents=True)
    work.mkdir(parents=True)
    argv, extra = command(agent, scratch, base, home, work, prompt)
    env = {
        **os.environ,
        **extra,
        "PWD": str(work),  # opencode works in $PWD, not in its working directory
        "HTTPS_PROXY": refuser.url,
        "HTTP_PROXY": refuser.url,
        "https_proxy": refuser.url,
        "http_proxy": refuser.url,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    recorder.requests, recorder.drive = [], drive
    started = time.monotonic()
    # Its own process group, so a turn past its time ends with every process it started
    # (Qwen Code's node children outlived a plain kill).
    agent_run = subprocess.Popen(
        argv,
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        output, _ = agent_run.communicate(timeout=timeout)
        code = agent_run.returncode
    except subprocess.TimeoutExpired:
        os.killpg(agent_run.pid, signal.SIGKILL)
        output, _ = agent_run.communicate()
        code = "timeout"
    return {
        "agent": agent.name,
        "answer": answer_of(agent, output, home),
        "version": version_of(agent),
        "wire": agent.wire,
        "exit": code,
        "seconds": round(time.monotonic() - started, 1),
        "requests": list(recorder.requests),
        "output_tail": output[-1500:],
        "mcp_calls": _lines(home / MCP_CALLS),
    }


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def answer_of(agent: Agent, output: str, home: Path) -> str:
    """The agent's final answer: as it reports it where it can (Claude Code's JSON, Codex's
    last message), else its output's last line."""
    if agent.name.startswith("codex") and (home / "answer.txt").exists():
        return (home / "answer.txt").read_text().strip()[:80]
    if agent.name == "claude-code":
        for line in reversed(output.splitlines()):
            if line.startswith("{"):
                try:
                    return str(json.loads(line).get("result", ""))[:80]
                except json.JSONDecodeError:
                    break
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if agent.name == "aider":  # its answer, then "Tokens: N sent, M received."
        lines = lines[
            : next((i for i, line in enumerate(lines) if line.startswith("Tokens:")), len(lines))
        ]
    return lines[-1][:80] if lines else ""


def tool_result_sent(turn: dict) -> bool:
    """Whether a request after the driven one carried the tool's output back."""
    driven = [i for i, r in enumerate(turn["requests"]) if r["driven"]]
    if not driven:
        return False
    later = json.dumps([r["body"] for r in turn["requests"][driven[0] + 1 :]])
    return "pong" in later and any(
        marker in later for marker in ('"tool_result"', '"function_call_output"', '"role": "tool"')
    )


def table(turns: list[dict]) -> str:
    rows = [
        "| agent | version | wire API | turn | requests (status) | result |",
        "|---|---|---|---|---|---|",
    ]
    for turn in turns:
        statuses = ", ".join(
            f"{r['path'].split('?')[0].removeprefix('/v1/')} {r['status']}"
            + (" (driven)" if r["driven"] else "")
            for r in turn["requests"]
        )
        if turn["kind"] == "tool":
            result = "tool result sent back and answered" if turn["round_trip"] else "no round trip"
            if turn["mcp_calls"]:
                result = f"MCP server called with {turn['mcp_calls'][0]['arguments']}; " + result
            result += f": {turn['answer']!r}"
        else:
            result = f"{turn['answer']!r}"
        rows.append(
            f"| {turn['agent']} | {turn['version']} | {turn['wire']} | {turn['kind']} "
            f"| {statuses or 'none'} | {result} (exit {turn['exit']}, {turn['seconds']} s) |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/mlxspec-agents"))
    parser.add_argument("--install", action="store_true", help="install the pinned agents first")
    parser.add_argument("--url", help="a running serve (default: start one)")
    parser.add_argument("--serve-args", default="", help="extra `mlxspec serve` options")
    parser.add_argument("--only", nargs="*", help="agents to run (default: all)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--fixtures", type=Path, help="write each agent's first request here")
    parser.add_argument("--out", type=Path, help="the turns as JSON")
    args = parser.parse_args()
    if args.install:
        install(args.scratch)
    serve, url = None, args.url
    if url is None:
        serve, url = start_serve(args.serve_args)
    refuser = Refuser()
    threading.Thread(target=refuser.serve_forever, daemon=True).start()
    recorder = Recorder(url)
    base = recorder.start()
    turns = []
    try:
        for agent in AGENTS:
            if args.only and agent.name not in args.only:
                continue
            turn = run_turn(agent, args.scratch, recorder, base, refuser, PONG, None, args.timeout)
            turns.append({**turn, "kind": "one word"})
            if args.fixtures and turn["requests"]:
                first = turn["requests"][0]
                name = f"{agent.name}-{turn['version']}.json"
                keep = {k: first[k] for k in ("method", "path", "body")}
                (args.fixtures / name).write_text(json.dumps(keep, indent=1) + "\n")
            if agent.shell_tool is None:
                continue
            drive = Drive(agent.shell_tool, agent.shell_arguments)
            turn = run_turn(
                agent, args.scratch, recorder, base, refuser, TOOL_TURN, drive, args.timeout
            )
            turns.append({**turn, "kind": "tool", "round_trip": tool_result_sent(turn)})
    finally:
        if serve is not None:
            serve.terminate()
            serve.wait(30)
    print(table(turns))
    if refuser.tunnelled:
        print(f"\nLet through (npm registry, for opencode): {len(refuser.tunnelled)}")
    if refuser.tried:
        where = ", ".join(sorted(set(refuser.tried)))
        print(f"\nOutbound connections refused: {len(refuser.tried)} ({where})")
    if args.out:
        args.out.write_text(json.dumps({"turns": turns, "refused": refuser.tried}, indent=1))


if __name__ == "__main__":
    main()
