"""`mlxspec serve`: OpenAI-compatible and Anthropic APIs, local, over the speculative engine.

    app = create_app(RegistryProvider(load_registry()))

Modules: `app` (the app: worker, health, models, the key check), `openai_routes` (OpenAI's
chat and text completions), `anthropic_routes` + `anthropic` (Anthropic's messages and
their translations), `generations` (a request checked against the model and the limits),
`answering` (a generation's answer parts, for every dialect), `schemas` (OpenAI's request
bodies), `responses` (OpenAI's response shapes), `worker` (the one thread that runs
generations), `providers` (where models come from), `limits`, `errors` (each route's
dialect's error shape), `listen` (the socket, bound first).
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
