"""`mlxspec cache`: the prompt caches kept on disk, listed and cleared."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mlxspec.cli.errors import fail_cleanly
from mlxspec.cli.options import JSON_OPTION


def _folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _summary(folder: Path) -> dict:
    """One model's folder: its key, files, bytes and the longest prompt kept."""
    from mlxspec.models.prompt_disk import SUFFIX, read_header

    files, key, longest = [], None, 0
    for path in folder.glob("*" + SUFFIX):
        if path.name.startswith("."):
            continue
        files.append(path)
        try:
            meta = read_header(path)
            key = key or meta.get("0.key")
            longest = max(longest, len(json.loads(meta.get("0.tokens", "[]"))))
        except (OSError, ValueError):
            pass
    return {
        "folder": str(folder),
        "model": key or folder.name,
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "longest_prompt_tokens": longest,
    }


@click.group()
def cache() -> None:
    """Prompt caches kept on disk (a restarted serve, or the next chat on the same
    system prompt, starts from them). In memory they go with the process."""


@cache.command("list")
@JSON_OPTION
@fail_cleanly
def list_(as_json: bool) -> None:
    """Each model's prompt caches on disk: files, size, longest prompt."""
    from mlxspec.registry.prompt_store import prompt_folder

    root = prompt_folder()
    if root is None:
        raise click.ClickException(
            "the prompt cache's disk tier is off (MLXSPEC_PROMPT_CACHE_DIR=off)"
        )
    rows = [_summary(folder) for folder in _folders(root)]
    if as_json:
        click.echo(json.dumps({"folder": str(root), "models": rows}))
        return
    if not rows:
        click.echo(f"no prompt caches in {root}")
        return
    for row in rows:
        size = row["bytes"] / (1 << 20)
        click.echo(
            f"{row['model']}: {row['files']} files, {size:.1f} MiB, "
            f"longest prompt {row['longest_prompt_tokens']} tokens"
        )
    click.echo(f"in {root}")


@cache.command()
@click.option("--yes", "-y", is_flag=True, help="Do not ask.")
@fail_cleanly
def clear(yes: bool) -> None:
    """Remove every prompt cache kept on disk."""
    import shutil

    from mlxspec.registry.prompt_store import prompt_folder

    root = prompt_folder()
    if root is None or not _folders(root):
        click.echo("no prompt caches on disk")
        return
    total = sum(_summary(f)["bytes"] for f in _folders(root))
    if not yes:
        click.confirm(f"remove {total / (1 << 20):.1f} MiB of prompt caches in {root}?", abort=True)
    for folder in _folders(root):
        shutil.rmtree(folder, ignore_errors=True)
    click.echo(f"removed {total / (1 << 20):.1f} MiB of prompt caches")
