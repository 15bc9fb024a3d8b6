"""mlxspec's own GGUF header reader (the gguf package's took 8.7 s on a 262k vocabulary)
reads what llama.cpp's writer wrote, as the package's reader does: every value type, the
tensor table and where the data lies; a torn or foreign file is one line."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from mlxspec.models.gguf_header import BadGGUFHeader, read_header
from mlxspec.models.gguf_reader import UnreadableGGUF, read_gguf_metadata


def write_sample(path, alignment: int | None = None):
    writer = GGUFWriter(str(path), "llama")
    if alignment:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.strings", ["a", "", "Ġthe", "<0x0A>"])
    writer.add_array("t.ints", [3, 1, 4, 1, 5])
    writer.add_array("t.floats", [0.5, -1.25])
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("b.weight", rng.standard_normal((5,)).astype(np.float16))
    q8 = quantize(rng.standard_normal((2, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("c.weight", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    # Q4_K blocks (144 bytes each 256 weights): their bytes are what the reader locates.
    q4k = rng.integers(0, 256, (2, 144), dtype=np.uint8)
    writer.add_tensor("d.weight", q4k, raw_shape=q4k.shape, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_header_reads_as_the_gguf_packages_reader_reads_it(tmp_path, alignment):
    path = write_sample(tmp_path / "sample.gguf", alignment)
    header = read_header(path)
    reader = GGUFReader(str(path))
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        ours = header.metadata[name]
        theirs = field.contents()
        if isinstance(ours, np.ndarray):
            assert ours.dtype == np.asarray(theirs).dtype or ours.dtype == field.parts[-1].dtype
            np.testing.assert_array_equal(ours, theirs)
        else:
            assert ours == theirs, name
            if not isinstance(ours, (str, bool, list)):
                assert ours.dtype == field.parts[-1].dtype, name
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    raw = path.read_bytes()
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert ours.dims == tuple(int(d) for d in theirs.shape)
        assert ours.type_id == theirs.tensor_type.value
        assert ours.start == theirs.data_offset
        assert raw[ours.start : ours.start + theirs.n_bytes] == theirs.data.tobytes()


def test_a_torn_header_is_one_line(tmp_path):
    path = write_sample(tmp_path / "sample.gguf")
    torn = tmp_path / "torn.gguf"
    torn.write_bytes(path.read_bytes()[:200])
    with pytest.raises(UnreadableGGUF, match=r"^torn\.gguf: a torn or invalid GGUF header"):
        read_gguf_metadata(torn)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 a zip, not a model"])
def test_a_file_that_is_no_gguf_is_one_line(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(BadGGUFHeader) as error:
        read_header(path)
    assert "\n" not in str(error.value) and "not a GGUF" in str(error.value)
