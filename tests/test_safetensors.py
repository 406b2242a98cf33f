"""loader.safetensors: byte-exact round trips for every dtype and every header/file defect."""
import json
import struct

import ml_dtypes
import numpy as np
import pytest

from loader.safetensors import (
    DTYPES,
    SafetensorsError,
    SafetensorsFile,
    TensorToWrite,
    save_arrays,
    write_safetensors,
)


def _random_array(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random raw bytes reinterpreted: every bit pattern of the dtype can occur (NaNs included)."""
    dt = DTYPES[dtype]
    if dtype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def _write_raw(path, header: dict, data: bytes, header_len: int | None = None) -> None:
    blob = json.dumps(header).encode()
    length = len(blob) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + blob + data)


def test_round_trip_every_dtype_bit_exact(tmp_path):
    rng = np.random.default_rng()
    arrays, dtypes = {}, {}
    for i, dtype in enumerate(DTYPES):
        shape = tuple(int(d) for d in rng.integers(1, 7, size=i % 3 + 1))
        arrays[f"t.{dtype}"] = _random_array(rng, dtype, shape)
        dtypes[f"t.{dtype}"] = dtype
    arrays["empty"] = np.zeros((0, 3), np.float32)
    path = tmp_path / "a.safetensors"
    size = save_arrays(path, arrays, dtypes)
    assert size == path.stat().st_size
    with SafetensorsFile.open(path) as f:
        assert sorted(f.keys()) == sorted(arrays)
        for name, want in arrays.items():
            got = f.get(name)
            assert got.shape == want.shape and got.dtype == want.dtype, name
            assert got.tobytes() == want.tobytes(), name  # bytes, so NaN patterns compare too
            assert not got.flags.writeable
            assert f.tensors[name].dtype == dtypes.get(name, "F32")


def test_reader_is_zero_copy_view_of_the_mapping(tmp_path):
    path = tmp_path / "a.safetensors"
    save_arrays(path, {"x": np.arange(64, dtype=np.float32)})
    f = SafetensorsFile.open(path)
    view = f.get("x")
    assert view.base is not None and not view.flags.owndata
    f.close()
    assert view[63] == 63.0  # views outlive close(): the mapping lives until they die
    with pytest.raises(SafetensorsError, match="closed"):
        f.get("x")


def test_writer_streams_and_leaves_nothing_on_error(tmp_path):
    path = tmp_path / "w.safetensors"
    specs = [TensorToWrite("a", "BF16", (4, 8)), TensorToWrite("b", "F8_E4M3", (3,))]
    calls = []

    def produce(t):
        calls.append(t.name)
        return np.zeros(t.shape, ml_dtypes.bfloat16)  # wrong dtype for 'b'

    with pytest.raises(SafetensorsError, match="'b'.*header says F8_E4M3"):
        write_safetensors(path, specs, produce)
    assert calls == ["a", "b"]
    assert list(tmp_path.iterdir()) == []
    # header padded to 8 bytes so aligned tensors stay aligned
    write_safetensors(path, specs[:1], lambda t: np.ones(t.shape, ml_dtypes.bfloat16),
                      metadata={"format": "pt"})
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0
    with SafetensorsFile.open(path) as f:
        assert f.metadata == {"format": "pt"}


def _valid(tmp_path):
    path = tmp_path / "v.safetensors"
    save_arrays(path, {"a": np.ones((4, 4), np.float32), "b": np.ones(8, np.int8)})
    return path


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:-3], "truncated: tensor 'b'"),
    (lambda b: b + b"xx", "2 trailing bytes"),
    (lambda b: b[:5], "too short"),
    (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "header length .* impossible"),
    (lambda b: b[:8] + b"!" + b[9:], "not valid UTF-8 JSON"),
])
def test_damaged_bytes_are_rejected(tmp_path, mutate, message):
    path = _valid(tmp_path)
    path.write_bytes(mutate(path.read_bytes()))
    with pytest.raises(SafetensorsError, match=message) as err:
        SafetensorsFile.open(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("entry, data, message", [
    ({"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, 1, "'x': unknown dtype 'F4'"),
    ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, "'x': F32\\[3\\] needs 12"),
    ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 4, "non-negative"),
    ({"x": {"dtype": "U8", "shape": [2], "data_offsets": [2, 0]}}, 2, "data_offsets must be"),
    ({"x": {"dtype": "U8", "shape": [2]}}, 2, "must have dtype, shape, data_offsets"),
    ({"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
      "y": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, 6, "'y' overlaps tensor 'x'"),
    ({"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
      "y": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}}, 6, "2 unindexed bytes"),
    ({"__metadata__": [1]}, 0, "__metadata__ must be"),
])
def test_bad_headers_are_rejected(tmp_path, entry, data, message):
    path = tmp_path / "h.safetensors"
    _write_raw(path, entry, bytes(data))
    with pytest.raises(SafetensorsError, match=message):
        SafetensorsFile.open(path)


def test_header_length_past_end_is_rejected(tmp_path):
    path = tmp_path / "h.safetensors"
    _write_raw(path, {}, b"", header_len=10_000)
    with pytest.raises(SafetensorsError, match="header length 10000 is impossible"):
        SafetensorsFile.open(path)


def test_offsets_out_of_order_in_json_are_fine(tmp_path):
    """Real files list tensors alphabetically while data follows another order."""
    rng = np.random.default_rng()
    b, a = rng.standard_normal(3).astype(np.float32), rng.standard_normal(2).astype(np.float32)
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
              "b": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}
    path = tmp_path / "o.safetensors"
    _write_raw(path, header, b.tobytes() + a.tobytes())
    with SafetensorsFile.open(path) as f:
        np.testing.assert_array_equal(f.get("a"), a)
        np.testing.assert_array_equal(f.get("b"), b)
