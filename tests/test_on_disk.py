"""Models where users already keep them: the Hugging Face cache, LM Studio's folder and
Ollama's store, laid out here as those tools lay them out (registry/on_disk.py cites each
layout), listed by `mlxspec models` and run by name without a copy."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_loading import save_tiny_llama
from tiny_gguf import write_tiny_gguf

from mlxspec.cli import main
from mlxspec.registry.models_toml import RegistryError, load_registry
from mlxspec.registry.on_disk import found_models


def ollama_store(root: Path, name: str, tag: str, gguf: Path, digest: str | None = None) -> Path:
    """Ollama's layout: the GGUF as blobs/sha256-DIGEST, named by a manifest's model layer."""
    data = gguf.read_bytes()
    real = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    blob = root / "blobs" / f"sha256-{real}"
    blob.write_bytes(data)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layers = [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest or real}"},
    ]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blob


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """One model in each place, and the places pointed at by their variables."""
    hub = tmp_path / "hf" / "hub"
    snapshot = hub / "models--someone--tiny-llama" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (hub / "models--someone--tiny-llama" / "refs").mkdir()
    (hub / "models--someone--tiny-llama" / "refs" / "main").write_text("abc123")
    save_tiny_llama(snapshot)
    lmstudio = tmp_path / "lmstudio"
    (lmstudio / "publisher" / "Tiny-GGUF").mkdir(parents=True)
    write_tiny_gguf(lmstudio / "publisher" / "Tiny-GGUF" / "tiny.Q8_0.gguf", "Q8_0")
    (lmstudio / "publisher" / "Other").mkdir(parents=True)
    (lmstudio / "publisher" / "Other" / "config.json").write_text('{"model_type": "nosuch"}')
    ollama = tmp_path / "ollama"
    source = write_tiny_gguf(tmp_path / "source.gguf", "Q4_1", seed=1)
    blob = ollama_store(ollama, "tiny", "latest", source)
    ollama_store(ollama, "broken", "latest", source, digest="f" * 64)  # names a missing blob
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("MLXSPEC_LMSTUDIO_MODELS", str(lmstudio))
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    return {"snapshot": snapshot, "blob": blob, "source": source}


def test_models_lists_what_each_place_holds_and_whether_it_runs(disk):
    found = {model.name: model for model in found_models()}
    assert set(found) == {
        "hf:someone/tiny-llama",
        "lmstudio:publisher/Tiny-GGUF",
        "lmstudio:publisher/Other",
        "ollama:tiny:latest",
    }
    assert found["hf:someone/tiny-llama"].path == disk["snapshot"]
    assert found["ollama:tiny:latest"].path == disk["blob"]  # the blob itself, no copy
    assert found["ollama:tiny:latest"].format == "gguf" and found["ollama:tiny:latest"].runnable
    assert "llama, F32/Q4_1" == found["ollama:tiny:latest"].why
    other = found["lmstudio:publisher/Other"]
    assert not other.runnable and "mlx-lm has no model for (nosuch)" in other.why
    listed = CliRunner().invoke(main, ["models", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {row["name"]: row for row in json.loads(listed.stdout)["found"]}
    assert rows["lmstudio:publisher/Tiny-GGUF"]["proposers"] == ["prompt-lookup", "suffix"]
    assert rows["hf:someone/tiny-llama"]["source"] == "Hugging Face cache"


def test_a_found_model_runs_by_its_name_where_it_lies(disk):
    entry = load_registry().including("ollama:tiny:latest").get("ollama:tiny:latest")
    assert Path(entry.target) == disk["blob"]
    # no tag is `latest`, as Ollama takes it
    assert Path(load_registry().including("ollama:tiny").get("ollama:tiny").target) == disk["blob"]
    args = ["generate", "one two one two", "-n", "6", "-p", "none", "--raw", "--json"]
    by_name = CliRunner().invoke(main, [*args, "-m", "ollama:tiny:latest"])
    by_path = CliRunner().invoke(main, [*args, "-m", str(disk["source"])])
    assert by_name.exit_code == 0 and by_path.exit_code == 0, by_name.output + by_path.output
    answer = json.loads(by_name.stdout.splitlines()[-1])
    assert answer["text"] == json.loads(by_path.stdout.splitlines()[-1])["text"]
    hf = CliRunner().invoke(main, [*args, "-m", "hf:someone/tiny-llama"])
    assert hf.exit_code == 0, hf.output


def test_a_found_name_that_is_not_there_is_one_line(disk):
    with pytest.raises(RegistryError, match=r"no model 'ollama:broken:latest' in .*ollama"):
        load_registry().including("ollama:broken:latest")  # its manifest names a missing blob
    result = CliRunner().invoke(main, ["generate", "hi", "-m", "lmstudio:nobody/none"])
    assert result.exit_code != 0 and "no model 'lmstudio:nobody/none'" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("offline", ["1", "0"])
def test_a_hub_pull_takes_the_copy_already_in_the_hugging_face_cache(disk, offline):
    """What mlx-lm (or `hf download`) fetched is not fetched again: `pull` and `--model` of
    the hub id find it in huggingface_hub's cache, offline (this machine reaches no hub)."""
    env = {**os.environ, "HF_HUB_OFFLINE": offline, "HF_HUB_ETAG_TIMEOUT": "2"}
    run = [sys.executable, "-m", "mlxspec"]
    pulled = subprocess.run(
        [*run, "pull", "someone/tiny-llama"], env=env, capture_output=True, text=True, timeout=120
    )
    assert pulled.returncode == 0, pulled.stderr
    assert f"someone/tiny-llama: {disk['snapshot']}" in pulled.stderr + pulled.stdout
    answer = subprocess.run(
        [*run, "generate", "one two", "-n", "4", "-p", "none", "-m", "someone/tiny-llama"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert answer.returncode == 0, answer.stderr
    missing = subprocess.run(
        [*run, "pull", "someone/not-here"], env=env, capture_output=True, text=True, timeout=120
    )
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "cannot reach the Hugging Face hub to fetch someone/not-here" in missing.stderr


def test_lm_studio_and_ollama_folders_can_be_named_in_models_toml(disk, tmp_path, monkeypatch):
    moved = tmp_path / "external-drive"
    (tmp_path / "lmstudio").rename(moved)
    monkeypatch.delenv("MLXSPEC_LMSTUDIO_MODELS")
    monkeypatch.delenv("OLLAMA_MODELS")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.ollama, no ~/.lmstudio
    models = tmp_path / "models.toml"
    models.write_text(f'[places]\nlmstudio = "{moved}"\nollama = "{tmp_path / "ollama"}"\n')
    monkeypatch.setenv("MLXSPEC_MODELS", str(models))
    listed = CliRunner().invoke(main, ["models", "--json"])
    assert listed.exit_code == 0, listed.output
    facts = json.loads(listed.stdout)
    assert facts["places"]["LM Studio"] == str(moved)
    names = {row["name"] for row in facts["found"]}
    assert {"lmstudio:publisher/Tiny-GGUF", "ollama:tiny:latest"} <= names
    entry = load_registry().including("ollama:tiny:latest").get("ollama:tiny:latest")
    assert Path(entry.target) == disk["blob"]
    models.write_text('[places]\nlmstudios = "/x"\n')
    wrong = CliRunner().invoke(main, ["models"])
    assert wrong.exit_code != 0 and "[places] has 'lmstudios'; known keys: lmstudio, ollama" in (
        wrong.output
    )


def test_lm_studio_is_found_where_its_models_directory_setting_says(disk, tmp_path, monkeypatch):
    """LM Studio's My Models tab moves its models folder by writing `downloadsFolder` into
    its settings.json: in its home (current releases) or in Electron's app data (older
    ones; LMSPLS's launchLMS.cmd rewrites that key there). A setting naming no folder
    here, or a torn file, leaves the default."""
    home = tmp_path / "home"
    (home / ".lmstudio" / "models").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("MLXSPEC_LMSTUDIO_MODELS")
    moved = tmp_path / "external-drive" / "models"
    moved.parent.mkdir()
    (tmp_path / "lmstudio").rename(moved)
    settings = home / ".lmstudio" / "settings.json"
    settings.write_text(json.dumps({"downloadsFolder": str(moved), "theme": "dark"}))
    assert "lmstudio:publisher/Tiny-GGUF" in {model.name for model in found_models()}
    assert f"LM Studio: {moved}\n" in CliRunner().invoke(main, ["models"]).output
    settings.write_text(json.dumps({"downloadsFolder": str(tmp_path / "unplugged")}))
    assert not any(model.name.startswith("lmstudio:") for model in found_models())
    settings.write_text('{"downloadsFolder": ')  # torn
    assert not any(model.name.startswith("lmstudio:") for model in found_models())
    settings.unlink()
    app_data = home / "Library" / "Application Support" / "LM Studio"
    app_data.mkdir(parents=True)
    (app_data / "settings.json").write_text(json.dumps({"downloadsFolder": str(moved)}))
    assert "lmstudio:publisher/Tiny-GGUF" in {model.name for model in found_models()}


def test_lm_studio_is_found_where_its_home_pointer_says(disk, tmp_path, monkeypatch):
    """LM Studio's app and `lms` read their home from ~/.lmstudio-home-pointer."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("MLXSPEC_LMSTUDIO_MODELS")
    lm_home = tmp_path / "lm-home"
    lm_home.mkdir()
    (tmp_path / "lmstudio").rename(lm_home / "models")
    (home / ".lmstudio-home-pointer").write_text(f"{lm_home}\n")
    assert "lmstudio:publisher/Tiny-GGUF" in {model.name for model in found_models()}
    text = CliRunner().invoke(main, ["models"]).output
    assert f"LM Studio: {lm_home / 'models'}\n" in text
    (home / ".lmstudio-home-pointer").unlink()
    assert not any(model.name.startswith("lmstudio:") for model in found_models())
    assert f"LM Studio: {home / '.lmstudio' / 'models'} (absent)" in (
        CliRunner().invoke(main, ["models"]).output
    )
