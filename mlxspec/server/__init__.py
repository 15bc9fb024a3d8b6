"""`mlxspec serve`: OpenAI-compatible and Anthropic APIs, local, over the speculative engine.

    app = create_app(RegistryProvider(load_registry()))

A dialect is a folder: `openai/` (chat and text completions: routes, request bodies,
replies, logprobs) and `anthropic/` (messages: routes and translations), each in and out of
the one request shape the core serves. The core: `app` (the app: worker, health, models, the
key check; it mounts each dialect's routes), `request_body` (what every dialect's request is
read into), `generations` (a request checked against the model and the limits), `answering`
(a generation's answer parts, for every dialect), `worker`, `batch_worker` and `sharded` (the
thread that runs generations: one at a time, batched, on ranks), `providers` (where models
come from), `limits`, `errors` (each route's dialect's error shape), `origin_guard` (only
the user reaches the server: Host and Origin checked), `listen` (the socket, bound first),
`background` (the server on a thread, for in-process clients), `lone_surrogates` (half an
emoji read as U+FFFD).
"""

from mlxspec.server.app import create_app, run_server
from mlxspec.server.limits import ServerLimits
from mlxspec.server.listen import ListenError, bind_listening_socket
from mlxspec.server.providers import ModelInfo, ModelProvider, RegistryProvider

__all__ = [
    "ListenError",
    "bind_listening_socket",
    "ModelInfo",
    "ModelProvider",
    "RegistryProvider",
    "ServerLimits",
    "create_app",
    "run_server",
]
