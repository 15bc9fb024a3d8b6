"""PyTorch checkpoints (`pytorch_model.bin`) read without torch.

SafeAILab publishes its EAGLE heads only this way, and a Mac running MLX rarely has
torch. `torch.save` writes a zip: `<name>/data.pkl`, a pickle whose tensors point (by
persistent id) at raw little-endian storages `<name>/data/<key>`. A restricted
unpickler rebuilds them as numpy arrays and refuses every other global, so reading a
checkpoint runs none of its code.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

# Storage classes as torch pickles them, and how their bytes read (bfloat16: see _decode).
STORAGES: dict[str, Any] = {
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": "bfloat16",
    "DoubleStorage": np.float64,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class TorchCheckpointError(ValueError):
    """Not a checkpoint this reader understands: one line for the user."""


class _StorageType:
    def __init__(self, name: str):
        self.name = name


def _decode(raw: bytes, storage: str) -> np.ndarray:
    """A storage's bytes as a flat array; bfloat16 (no numpy type) widens to float32."""
    if STORAGES[storage] == "bfloat16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, STORAGES[storage])


def _rebuild_tensor(storage: np.ndarray, offset: int, size, stride, *_) -> np.ndarray:
    strides = tuple(s * storage.itemsize for s in stride)
    view = np.lib.stride_tricks.as_strided(storage[offset:], tuple(size), strides)
    return np.array(view)


def _rebuild_parameter(data: np.ndarray, *_) -> np.ndarray:
    return data


_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, archive: zipfile.ZipFile, prefix: str):
        super().__init__(file)
        self.archive, self.prefix = archive, prefix

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in STORAGES:
            return _StorageType(name)
        if (module, name) in _GLOBALS:
            return _GLOBALS[(module, name)]
        raise TorchCheckpointError(f"it holds {module}.{name}, not just tensors")

    def persistent_load(self, pid) -> np.ndarray:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise TorchCheckpointError(f"unknown storage reference {pid!r}")
        _, storage_type, key, _location, _count = pid
        return _decode(self.archive.read(f"{self.prefix}data/{key}"), storage_type.name)


def read_torch_bin(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a state dict saved by `torch.save` (zip format, torch >= 1.6)."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if not pickles:
                raise TorchCheckpointError("no data.pkl inside")
            prefix = pickles[0][: -len("data.pkl")]
            with archive.open(pickles[0]) as file:
                state = _Unpickler(file, archive, prefix).load()
    except zipfile.BadZipFile:
        raise TorchCheckpointError(
            f"{path} is not a zip-format PyTorch checkpoint (saved before torch 1.6?)"
        ) from None
    except TorchCheckpointError as err:
        raise TorchCheckpointError(f"cannot read {path}: {err}") from None
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError) as err:
        raise TorchCheckpointError(f"cannot read {path}: damaged ({err})") from None
    if not isinstance(state, dict):
        raise TorchCheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
    return {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
