"""loader.checkpoint: a synthetic tiny checkpoint opens; every kind of damage is reported, together."""
import json
import shutil

import numpy as np
import pytest
from tiny_checkpoint import tiny_checkpoint

from loader import checkpoint as ckpt_module
from loader.checkpoint import INDEX_NAME, MAX_REPORTED, Checkpoint, CheckpointError
from loader.config import ModelConfig
from loader.safetensors import SafetensorsFile, save_arrays
from loader.schema import checkpoint_schema


@pytest.fixture(scope="module")
def pristine():
    return tiny_checkpoint()


@pytest.fixture
def ckdir(pristine, tmp_path):
    """A copy to damage: JSON files copied, shards symlinked (damage replaces a link, see _replace)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    for p in pristine.iterdir():
        if p.suffix == ".safetensors":
            (d / p.name).symlink_to(p)
        else:
            shutil.copy(p, d / p.name)
    return d


def _replace(path, data: bytes):
    path.unlink()  # never write through the symlink into the shared pristine shard
    path.write_bytes(data)


def _index(d):
    return json.loads((d / INDEX_NAME).read_text())


def _write_index(d, index):
    (d / INDEX_NAME).write_text(json.dumps(index))


def _rewrite_shard(d, shard, change):
    """Rewrite one shard with `change(arrays, dtypes)` applied to its tensors (E8M0 kept)."""
    with SafetensorsFile.open(d / shard) as f:
        arrays = {n: np.array(f.get(n)) for n in f.tensors}
        dtypes = {n: f.tensors[n].dtype for n in f.tensors}
    change(arrays, dtypes)
    save_arrays(d / shard, arrays, {n: t for n, t in dtypes.items() if n in arrays})


def _shard_of(d, name):
    return _index(d)["weight_map"][name]


def _open_fails(d, *fragments):
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(d, progress=False)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))
    return err.value


def test_pristine_opens_and_matches_schema(pristine):
    cfg = ModelConfig.preset("tiny")
    with Checkpoint.open(pristine, progress=False) as ck:
        assert ck.config == cfg
        schema = checkpoint_schema(cfg)
        assert ck.names == [t.name for t in schema]
        assert len(ck.files) > 3
        for t in schema:
            a = ck.get(t.name)
            assert a.shape == t.shape and not a.flags.writeable
        with pytest.raises(KeyError, match="no tensor 'nope'"):
            ck.get("nope")


def test_single_file_checkpoint(pristine, tmp_path):
    d = tmp_path / "one"
    d.mkdir()
    shutil.copy(pristine / "config.json", d)
    with Checkpoint.open(pristine, progress=False) as ref:
        save_arrays(d / "model.safetensors", {n: ref.get(n) for n in ref.names},
                    {n: t.dtype for n, t in ref.specs.items()})
    with Checkpoint.open(d, progress=False) as ck, Checkpoint.open(pristine, progress=False) as ref:
        assert ck.names == ref.names and len(ck.files) == 1
        assert all(ck.get(n).tobytes() == ref.get(n).tobytes() for n in ref.names)


def test_truncated_shard(ckdir):
    shard = _shard_of(ckdir, "layers.4.attn.wo_b.weight")
    path = ckdir / shard
    _replace(path, path.read_bytes()[:-100])
    _open_fails(ckdir, shard, "truncated")


def test_corrupt_header(ckdir):
    shard = _shard_of(ckdir, "head.weight")
    raw = bytearray((ckdir / shard).read_bytes())
    raw[8:12] = b"\xff\xfe{["
    _replace(ckdir / shard, bytes(raw))
    _open_fails(ckdir, shard, "not valid UTF-8 JSON")


def test_oversized_header(ckdir):
    shard = _shard_of(ckdir, "embed.weight")
    raw = bytearray((ckdir / shard).read_bytes())
    raw[:8] = (1 << 33).to_bytes(8, "little")
    _replace(ckdir / shard, bytes(raw))
    _open_fails(ckdir, shard, "header length 8589934592 is impossible")


def test_wrong_dtype_and_shape(ckdir):
    a, b = "layers.0.attn.attn_sink", "layers.2.attn.wq_b.scale"
    shard_a, shard_b = _shard_of(ckdir, a), _shard_of(ckdir, b)

    def to_bf16(arrays, dtypes):
        arrays[a] = arrays[a].astype(np.float16)
        dtypes[a] = "F16"
    _rewrite_shard(ckdir, shard_a, to_bf16)

    def reshape(arrays, dtypes):
        arrays[b] = arrays[b].reshape(-1)
    _rewrite_shard(ckdir, shard_b, reshape)
    _open_fails(ckdir, f"'{a}' is F16[16], expected F32[16]",
                f"'{b}' is F8_E8M0[{16 * 512 // 32 * 256 // 32}], expected F8_E8M0[256, 8]")


def test_missing_and_unexpected_tensors(ckdir):
    gone, extra = "layers.5.ffn.gate.bias", "layers.5.ffn.gate.typo"
    shard = _shard_of(ckdir, gone)

    def change(arrays, dtypes):
        del arrays[gone]
        arrays[extra] = np.zeros(4, np.float32)
        arrays["vision.patch_embed.weight"] = np.zeros(4, np.float32)  # ignored, not an error
        dtypes[extra] = dtypes["vision.patch_embed.weight"] = "F32"
    _rewrite_shard(ckdir, shard, change)
    index = _index(ckdir)
    del index["weight_map"][gone]
    index["weight_map"][extra] = index["weight_map"]["vision.patch_embed.weight"] = shard
    _write_index(ckdir, index)
    err = _open_fails(ckdir, f"missing tensor '{gone}' (expected F32[16])",
                      f"unexpected tensor '{extra}'")
    assert len(err.problems) == 2


def test_nan_scale_and_nonfinite_norm(ckdir):
    scale, norm = "layers.6.ffn.experts.3.w1.scale", "layers.1.attn_norm.weight"

    def poison(arrays, dtypes):
        if scale in arrays:
            arrays[scale][17, 5] = 0xFF
        if norm in arrays:
            arrays[norm][200] = np.inf
    for shard in {_shard_of(ckdir, scale), _shard_of(ckdir, norm)}:
        _rewrite_shard(ckdir, shard, poison)
    _open_fails(ckdir, f"'{scale}': 1 NaN scale byte 0xFF(s), first at [17, 5]",
                f"'{norm}': 1 non-finite value(s), first at [200]")
    # scan="none" reads headers only and accepts the values
    Checkpoint.open(ckdir, scan="none", progress=False).close()


def test_index_names_missing_shard(ckdir):
    shard = _shard_of(ckdir, "layers.9.attn.wq_a.weight")
    (ckdir / shard).unlink()
    err = _open_fails(ckdir, f"{shard}: missing, but {INDEX_NAME} maps")
    assert len(err.problems) == 1  # reported once for the shard, not once per tensor in it


def test_index_points_at_wrong_shard(ckdir):
    index = _index(ckdir)
    name = "layers.0.hc_ffn_fn"
    right = index["weight_map"][name]
    wrong = next(s for s in sorted(set(index["weight_map"].values())) if s != right)
    index["weight_map"][name] = wrong
    _write_index(ckdir, index)
    _open_fails(ckdir, f"maps '{name}' to {wrong}, but it is in {right}")


def test_shard_tensor_not_in_index(ckdir):
    index = _index(ckdir)
    name = "norm.weight"
    shard = index["weight_map"].pop(name)
    _write_index(ckdir, index)
    _open_fails(ckdir, f"{shard}: tensor '{name}' is not listed in {INDEX_NAME}")


def test_problems_are_collected_and_capped(ckdir):
    index = _index(ckdir)
    dropped = [n for n in index["weight_map"] if ".experts." in n][:MAX_REPORTED + 7]
    for name in dropped:
        del index["weight_map"][name]
    _write_index(ckdir, index)
    err = _open_fails(ckdir, "and 7 more")
    assert len(err.problems) == MAX_REPORTED + 7


def test_bad_config_and_layout(ckdir, tmp_path):
    cfg = json.loads((ckdir / "config.json").read_text())
    cfg["hidden_size"] = 250
    (ckdir / "config.json").write_text(json.dumps(cfg))
    _open_fails(ckdir, "config.json", "hidden_size")
    (ckdir / "config.json").unlink()
    _open_fails(ckdir, "config.json", "not found")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(ckdir.parent / "ckpt" / INDEX_NAME, empty / "x.json")
    ModelConfig.preset("tiny").to_json(empty / "config.json")
    _open_fails(empty, f"neither {INDEX_NAME} nor model.safetensors exists")
    (empty / INDEX_NAME).write_text("{not json")
    _open_fails(empty, f"{INDEX_NAME}: unreadable")


def test_failed_open_leaves_nothing_mapped(ckdir, monkeypatch):
    opened = []
    real_open = SafetensorsFile.open.__func__

    def tracking_open(cls, path):
        f = real_open(cls, path)
        opened.append(f)
        return f
    monkeypatch.setattr(ckpt_module.SafetensorsFile, "open", classmethod(tracking_open))
    name = "layers.8.attn.attn_sink"
    _rewrite_shard(ckdir, _shard_of(ckdir, name),
                   lambda arrays, dtypes: arrays[name].__setitem__(0, np.nan))
    _open_fails(ckdir, "non-finite")
    assert len(opened) > 3
    assert all(f._mmap is None and f._bytes is None for f in opened)


def test_progress_goes_to_stderr(pristine, capsys):
    Checkpoint.open(pristine, progress=True).close()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "validate ckpt:" in captured.err and "GB" in captured.err


def test_damage_never_reached_the_shared_shards(pristine):
    """The damage tests replace symlinks; the pristine checkpoint must still be valid."""
    Checkpoint.open(pristine, scan="all", progress=False).close()
