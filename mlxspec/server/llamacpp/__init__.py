"""llama.cpp's own completion endpoints, `/infill` and `/completion`: what llama.vim,
llama.vscode and Tabby's llama.cpp backend send."""

from mlxspec.server.llamacpp.routes import llamacpp_router

__all__ = ["llamacpp_router"]
