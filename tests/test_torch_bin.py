"""Reading PyTorch checkpoints without torch. torch is not installed here, so the test
writes one as `torch.save` lays it out (a zip of data.pkl + raw storages; tensors
pickled as torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...), storages
as persistent ids ('storage', torch.<Type>Storage, key, location, numel)), with
stand-in `torch` modules so that pickle writes the very same global names."""

from __future__ import annotations

import collections
import io
import pickle
import sys
import types
import zipfile

import numpy as np
import pytest

from mlxspec.drafter.torch_bin import TorchCheckpointError, read_torch_bin


class FakeTensor:
    def __init__(self, storage_type, data: np.ndarray, offset=0, size=None, stride=None):
        self.storage_type, self.data = storage_type, data  # data: the flat storage
        self.offset, self.size, self.stride = offset, size, stride

    def __reduce__(self):
        rebuild = sys.modules["torch._utils"]._rebuild_tensor_v2
        hooks = collections.OrderedDict()
        return rebuild, (self, self.offset, self.size, self.stride, False, hooks)


def fake_torch(monkeypatch):
    torch, utils = types.ModuleType("torch"), types.ModuleType("torch._utils")
    for name in ("FloatStorage", "HalfStorage", "BFloat16Storage", "LongStorage", "BoolStorage"):
        cls = type(name, (), {"__module__": "torch"})
        setattr(torch, name, cls)

    def _rebuild_tensor_v2(*args):
        raise AssertionError("only pickled, never called")

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    torch._utils = utils
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch._utils", utils)
    return torch


def torch_save(path, state: dict, name="archive"):
    """What torch.save writes for `state` (values: FakeTensor)."""
    storages: dict[int, FakeTensor] = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, FakeTensor) and obj in storages.values():
                key = next(k for k, v in storages.items() if v is obj)
                return ("storage", obj.storage_type, str(key), "cpu", obj.data.size)
            return None

        def reducer_override(self, obj):
            if isinstance(obj, FakeTensor) and obj not in storages.values():
                storages[len(storages)] = obj
            return NotImplemented

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(collections.OrderedDict(state))
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/data.pkl", buffer.getvalue())
        for key, tensor in storages.items():
            archive.writestr(f"{name}/data/{key}", tensor.data.tobytes())
        archive.writestr(f"{name}/version", "3\n")


def test_a_torch_checkpoint_reads_back_exactly(tmp_path, monkeypatch):
    torch = fake_torch(monkeypatch)
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(3, 4)).astype(np.float32)
    half = rng.normal(size=(5,)).astype(np.float16)
    wanted_bf16 = np.array([1.0, -2.5, 0.15625, 2.0**100], np.float32)  # exact in bf16
    bf16_bits = (wanted_bf16.view(np.uint32) >> 16).astype(np.uint16)
    d2t = np.array([0, 3, 3, 7], np.int64)
    t2d = np.array([True, False, True])
    state = {
        "fc.weight": FakeTensor(torch.FloatStorage, weight.ravel(), 0, (3, 4), (4, 1)),
        # a transposed view of the same kind of storage: strides (1, 4)
        "fc.weight_t": FakeTensor(torch.FloatStorage, weight.ravel(), 0, (4, 3), (1, 4)),
        "norm.weight": FakeTensor(torch.HalfStorage, np.concatenate([half, half]), 5, (5,), (1,)),
        "bf16": FakeTensor(torch.BFloat16Storage, bf16_bits, 0, (4,), (1,)),
        "d2t": FakeTensor(torch.LongStorage, d2t, 0, (4,), (1,)),
        "t2d": FakeTensor(torch.BoolStorage, t2d, 0, (3,), (1,)),
    }
    torch_save(tmp_path / "pytorch_model.bin", state)
    monkeypatch.delitem(sys.modules, "torch")  # the reader must not need it
    got = read_torch_bin(tmp_path / "pytorch_model.bin")
    assert set(got) == set(state)
    assert np.array_equal(got["fc.weight"], weight)
    assert np.array_equal(got["fc.weight_t"], weight.T)
    assert got["norm.weight"].dtype == np.float16 and np.array_equal(got["norm.weight"], half)
    assert np.array_equal(got["bf16"], wanted_bf16)
    assert got["d2t"].dtype == np.int64 and np.array_equal(got["d2t"], d2t)
    assert np.array_equal(got["t2d"], t2d)


def test_checkpoints_with_code_or_no_zip_are_refused_in_one_line(tmp_path):
    class Sneaky:
        def __reduce__(self):
            return (print, ("ran",))

    buffer = io.BytesIO()
    pickle.dump({"x": Sneaky()}, buffer, protocol=2)
    with zipfile.ZipFile(tmp_path / "evil.bin", "w") as archive:
        archive.writestr("archive/data.pkl", buffer.getvalue())
    with pytest.raises(TorchCheckpointError, match="print, not just tensors"):
        read_torch_bin(tmp_path / "evil.bin")
    (tmp_path / "old.bin").write_bytes(b"\x80\x02legacy torch format")
    with pytest.raises(TorchCheckpointError, match="not a zip-format"):
        read_torch_bin(tmp_path / "old.bin")
