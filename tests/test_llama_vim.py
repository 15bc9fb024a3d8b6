"""llama.vim, the real plugin (ggml-org/llama.vim, vendored under tests/data/llama.vim),
completing a hole in a real vim in a real terminal (tmux) against `mlxspec serve`.

The served model is a tiny llama saved as an mlx-lm folder, its tokenizer holding
Qwen2.5-Coder's FIM tokens, rigged (scripted.py) to fill any hole with one line: so what
llama.vim must show and insert is known, and only the request llama.vim sends, the FIM
prompt the server lays out and the reply llama.vim parses decide whether it appears.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config
from scripted import scripted_config, scripted_model
from terminal import IN_CI, Terminal, needs_tmux
from test_infill import QWEN_FIM, fim_tokenizer

pytestmark = [
    needs_tmux,
    pytest.mark.skipif(
        shutil.which("vim") is None and not IN_CI, reason="needs vim (.ci/run installs it)"
    ),
]

PLUGIN = Path(__file__).parent / "data" / "llama.vim"
# The cursor inside a line (on its `#`): at a line's end, vim's <C-O>, which llama.vim's
# accept key uses, moves the cursor back a character before llama.vim reads it.
ANSWER = "a + b "
HOLE = "def add(a, b):\n    return # the sum\n\n\nprint(add(1, 2))\n"
FILLED = "    return a + b # the sum"


def save_hole_filler(folder: Path) -> None:
    """The rigged llama as mlx-lm saves a model: config, weights, tokenizer."""
    tokenizer = fim_tokenizer_with(ANSWER)
    model = scripted_model(tokenizer, [ANSWER], tokenizer.get_vocab()["<|fim_middle|>"])
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    save_config(scripted_config(tokenizer), folder / "config.json")
    tokenizer._tokenizer.save_pretrained(folder)


def fim_tokenizer_with(answer: str):
    """The FIM byte tokenizer with the answer as one more token of its own."""
    from tiny_models import byte_tokenizer

    tokenizer = byte_tokenizer([*QWEN_FIM, answer])
    tokenizer._tokenizer.add_special_tokens({"additional_special_tokens": QWEN_FIM})
    return tokenizer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_llama_vim_completes_a_hole_from_the_served_model(tmp_path):
    assert fim_tokenizer().get_vocab()["<|fim_middle|>"]  # the same tokens as test_infill's
    model = tmp_path / "hole-filler"
    save_hole_filler(model)
    port = free_port()
    env = {**os.environ, "MLXSPEC_DATA": str(tmp_path / "data")}
    env["MLXSPEC_CACHE"] = str(tmp_path / "cache")
    command = [sys.executable, "-m", "mlxspec", "serve", "-m", str(model), "--port", str(port)]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_until_serving(port, server)
        source = tmp_path / "hole.py"
        source.write_text(HOLE)
        vimrc = tmp_path / "vimrc"
        vimrc.write_text(
            "set nocompatible\n"
            f"set runtimepath^={PLUGIN}\n"
            f"let g:llama_config = {{'endpoint_fim': 'http://127.0.0.1:{port}/infill',"
            " 'auto_fim': v:false, 'show_info': 0, 'keymap_fim_trigger': '<C-F>',"
            " 't_max_predict_ms': 5000}\n"
            "filetype plugin on\n"
        )
        with Terminal(f"vim -u {vimrc} -i NONE -N {source}", width=100, height=20) as term:
            term.wait_for(lambda screen: "print(add(1, 2))" in screen, 30)
            term.send("2G", "f#", "i")
            time.sleep(0.5)
            term.send("C-f")
            shown = term.wait_for(lambda screen: ANSWER.strip() in screen, 60)
            assert ANSWER.strip() in shown, f"llama.vim showed no suggestion:\n{shown}"
            term.send("Tab")
            time.sleep(0.5)
            term.send("Escape", ":wq", "Enter")
            deadline = time.monotonic() + 20
            while FILLED not in source.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
        assert source.read_text().splitlines()[1] == FILLED
    finally:
        server.terminate()
        log = server.communicate(timeout=30)[0].decode(errors="replace")
    assert "POST /infill" in log


def _wait_until_serving(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"serve exited: {server.communicate()[0].decode(errors='replace')}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail("serve did not answer /health in 120 s")
