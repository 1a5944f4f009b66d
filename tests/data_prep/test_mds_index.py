"""A dataset's index.json cannot make a reader leave the dataset's directory (data_prep/mds_index.py):
each escape is first shown to work against Streaming itself, then refused by every way gpn-scale
opens a dataset (the training loader, its remote cache, eval's reader, prep's resume, train's
preflight), with the marker file never written."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.mds_fixture import write_windows

from data_prep import mds_index
from data_prep.errors import UserError
from gpn_scale.eval.prep_output import open_prep_output, read_windows
from gpn_scale.storage.mds_datasets import dataset_class, open_dataset, registering, release
from gpn_scale.train.batches import ShuffledBatches
from support import ROOT

TINY = ROOT / "configs" / "train" / "gpn_m_tiny.yaml"
SEQ = 16


def _zstd_windows(out: Path, n: int = 8) -> Path:
    from streaming import MDSWriter

    rng = np.random.default_rng(1)
    with MDSWriter(out=str(out), columns={"tokens": f"ndarray:uint16:{SEQ}"}, compression="zstd") as w:
        for _ in range(n):
            w.write({"tokens": rng.integers(0, 50, SEQ).astype(np.uint16)})
    return out


def _index(split: Path) -> dict:
    return json.loads((split / "index.json").read_text())


def _write_index(split: Path, index: dict) -> None:
    (split / "index.json").write_text(json.dumps(index))


@pytest.fixture
def home(tmp_path):
    """tmp/data/{train}: a dataset; tmp/elsewhere: outside it (where an attack reads or writes)."""
    (tmp_path / "elsewhere").mkdir()
    write_windows(tmp_path / "data" / "train", 8, SEQ, 50)
    return tmp_path


def _streaming_reads(local: Path, remote: str | None = None) -> list:
    """Streaming without gpn-scale's check: every sample, through its own loader (registered under
    the node's lock, as every dataset of the suite is: tests/support/streaming_guard.py)."""
    with registering():
        ds = dataset_class()(local=str(local), remote=remote, shuffle=False, batch_size=1)
    try:
        return [ds[i]["tokens"] for i in range(len(ds))]
    finally:
        release(ds)


def _all_openers_refuse(split: Path, match: str) -> None:
    with pytest.raises(UserError, match=match):
        open_dataset(local=str(split), shuffle=False, batch_size=1)
    with pytest.raises(UserError, match=match):
        ShuffledBatches(str(split), None, 2, 1, shuffle=False, seed=0, num_canonical_nodes=1)
    with pytest.raises(UserError, match=match):
        read_windows(open_prep_output(split))


def test_a_read_through_dotdot_or_an_absolute_path_is_refused(home):
    split, outside = home / "data" / "train", home / "elsewhere"
    index = _index(split)
    name = index["shards"][0]["raw_data"]["basename"]
    shutil.move(split / name, outside / name)
    for basename in (f"../../elsewhere/{name}", str(outside / name)):
        index["shards"][0]["raw_data"]["basename"] = basename
        _write_index(split, index)
        assert len(_streaming_reads(split)) == 8  # the gadget: Streaming reads the file outside
        _all_openers_refuse(split, r"shard 0: raw_data.basename: .* not a plain relative file name")


def test_a_write_through_decompression_is_refused_and_writes_nothing(tmp_path):
    split = _zstd_windows(tmp_path / "data")
    index = _index(split)
    shard = index["shards"][0]
    (split / shard["raw_data"]["basename"]).unlink(missing_ok=True)
    shard["raw_data"]["basename"] = "../planted.mds"
    _write_index(split, index)
    marker = tmp_path / "planted.mds"
    _all_openers_refuse(split, r"shard 0: raw_data.basename: '../planted.mds' is not a plain relative")
    assert not marker.exists()
    shutil.copytree(split, tmp_path / "copy")  # the same dataset, now given to Streaming alone
    _streaming_reads(tmp_path / "copy")
    assert (tmp_path / "planted.mds").exists()  # the gadget: Streaming wrote outside its directory


def test_a_write_through_streamings_staging_file_is_refused(tmp_path):
    """Streaming decompresses into NAME.tmp, then renames it: a symlink there would take the write."""
    split = _zstd_windows(tmp_path / "data")
    shard = _index(split)["shards"][0]
    raw = split / shard["raw_data"]["basename"]
    raw.unlink(missing_ok=True)
    target = tmp_path / "profile"
    target.write_text("untouched\n")
    (split / (raw.name + ".tmp")).symlink_to(target)
    _all_openers_refuse(split, r"shard 0: raw_data.basename: .*\.tmp, where Streaming writes .* is a symlink")
    assert target.read_text() == "untouched\n"
    shutil.copytree(split, tmp_path / "copy", symlinks=True)
    _streaming_reads(tmp_path / "copy")
    assert target.read_bytes() != b"untouched\n"  # the gadget: Streaming wrote the shard through the link


def test_a_shard_name_with_a_control_character_is_refused_on_one_line(home):
    split = home / "data" / "train"
    index = _index(split)
    index["shards"][0]["raw_data"]["basename"] = "shard\nerror: forged.mds"
    _write_index(split, index)
    with pytest.raises(UserError) as refused:
        mds_index.check(split)
    assert "\n" not in str(refused.value) and "not a plain relative file name" in str(refused.value)


def test_symlinks_leading_out_are_refused_inside_ones_are_not(home):
    split, outside = home / "data" / "train", home / "elsewhere"
    name = _index(split)["shards"][0]["raw_data"]["basename"]
    shutil.move(split / name, outside / name)
    (split / name).symlink_to(outside / name)
    assert len(_streaming_reads(split)) == 8
    _all_openers_refuse(split, "leads outside the dataset's directory")
    # a symlinked directory on the way out
    (split / name).unlink()
    (split / "sub").symlink_to(outside)
    index = _index(split)
    index["shards"][0]["raw_data"]["basename"] = f"sub/{name}"
    _write_index(split, index)
    _all_openers_refuse(split, "leads outside")
    # a symlink inside the directory is a plain file of the dataset
    (split / "sub").unlink()
    shutil.move(outside / name, split / "real.mds")
    (split / name).symlink_to(split / "real.mds")
    index["shards"][0]["raw_data"]["basename"] = name
    _write_index(split, index)
    assert len(read_windows(open_prep_output(split))) == 8


def test_a_remote_index_is_checked_before_it_reaches_the_cache(home):
    remote, cache = home / "data" / "train", home / "cache"
    index = _index(remote)
    good = json.dumps(index)
    index["shards"][0]["raw_data"]["basename"] = "../../elsewhere/planted.mds"
    _write_index(remote, index)
    bad = (remote / "index.json").read_text()
    with pytest.raises(UserError, match=r"index.json: shard 0: raw_data.basename"):
        ShuffledBatches(f"file://{remote}", str(cache), 2, 1, shuffle=False, seed=0, num_canonical_nodes=1)
    assert not any(cache.rglob("index.json*")), "a refused index stays out of the cache"
    (remote / "index.json").write_text(good)
    batches = ShuffledBatches(f"file://{remote}", str(cache), 2, 1, shuffle=False, seed=0, num_canonical_nodes=1)
    assert len(batches) == 8
    # A poisoned cache: an index already there (planted, or fetched before) is checked too.
    (next(cache.iterdir()) / "index.json").write_text(bad)
    with pytest.raises(UserError, match=r"shard 0: raw_data.basename"):
        ShuffledBatches(f"file://{remote}", str(cache), 2, 1, shuffle=False, seed=0, num_canonical_nodes=1)


def test_the_remote_gadget_writes_outside_the_cache_without_the_check(home):
    """Streaming, given a remote whose shard name climbs out: the fetched copy lands outside the cache."""
    remote, cache = home / "data" / "train", home / "cache" / "deep"
    index = _index(remote)
    name = index["shards"][0]["raw_data"]["basename"]
    index["shards"][0]["raw_data"]["basename"] = f"../{name}"
    _write_index(remote, index)
    shutil.copy(remote / name, remote.parent / name)  # what the remote serves under that name
    (remote / name).unlink()
    _streaming_reads(cache, remote=str(remote))
    assert (home / "cache" / name).exists()  # written beside the cache, not in it
    with pytest.raises(UserError, match=r"shard 0: raw_data.basename: '\.\./"):
        open_dataset(local=str(home / "cache2"), remote=str(remote), shuffle=False, batch_size=1)
    assert not (home / name).exists() and not any((home / "cache2").glob("index.json*"))


@pytest.mark.parametrize("edit, message", [
    (lambda s, d: s.__setitem__("raw_data", {**s["raw_data"], "bytes": s["raw_data"]["bytes"] + 1}),
     r"shard 0: raw_data.bytes: the index lists \d+, .* holds \d+ bytes"),
    (lambda s, d: s.__setitem__("raw_data", {**s["raw_data"], "hashes": {"sha1": "0" * 40}}),
     r"shard 0: raw_data.hashes.sha1: .* hashes to [0-9a-f]{40}, the index lists 0000"),
    (lambda s, d: s.__setitem__("raw_data", {**s["raw_data"], "hashes": {"crc7": "00"}}),
     r"shard 0: raw_data.hashes: none of \['crc7'\] is a hash gpn-scale checks"),
    (lambda s, d: s.__setitem__("samples", s["samples"] + 1), r"shard 0: samples: the index lists \d+, .* holds \d+ samples"),
    (lambda s, d: s.__setitem__("column_names", ["text"]), r"shard 0: column_names: no 'tokens' column \(columns: 'text'\)"),
    (lambda s, d: s.__setitem__("column_encodings", ["ndarray:float32:16"]),
     r"shard 0: column_encodings: 'tokens' is 'ndarray:float32:16', expected 'ndarray:<integer dtype>"),
    (lambda s, d: (s.__setitem__("column_names", ["tokens", "obj"]), s.__setitem__("column_encodings", ["ndarray:uint16:16", "pkl"]),
                   s.__setitem__("column_sizes", [32, None])), r"shard 0: column_encodings: column 'obj' is a pickle"),
    (lambda s, d: s.__setitem__("exec", "x"), r"shard 0: exec: not a field of an MDS shard"),
    (lambda s, d: s.__setitem__("format", "json"), r"shard 0: format/version: expected an MDS shard of version 2"),
    (lambda s, d: s.__setitem__("compression", "rot13"), r"shard 0: compression: expected null or one of Streaming's codecs"),
    (lambda s, d: d["shards"].append(json.loads(json.dumps(s))), r"shard 1: raw_data.basename: '.*' is also shard 0's file"),
    (lambda s, d: d["shards"].append({**json.loads(json.dumps(s)), "column_encodings": ["ndarray:uint16:32"],
                                      "raw_data": {**s["raw_data"], "basename": "other.mds"}}),
     r"shard 1: column_encodings: windows of uint16:32, shard 0's are uint16:16"),
    (lambda s, d: s["raw_data"].__setitem__("basename", "nothere.mds"), r"shard 0: raw_data.basename: .*nothere.mds is missing"),
])
def test_an_index_unlike_what_prep_writes_is_one_line_naming_the_shard_and_field(home, edit, message):
    split = home / "data" / "train"
    index = _index(split)
    index["shards"] = index["shards"][:1]
    edit(index["shards"][0], index)
    _write_index(split, index)
    with pytest.raises(UserError, match=message):
        mds_index.check(split)


def test_listed_hashes_that_match_pass(tmp_path):
    from streaming import MDSWriter

    with MDSWriter(out=str(tmp_path / "d"), columns={"tokens": "ndarray:int32:4"}, hashes=["sha1", "xxh64"]) as w:
        for i in range(3):
            w.write({"tokens": np.arange(4, dtype=np.int32) + i})
    info = mds_index.check(tmp_path / "d")
    assert (info.shards, info.samples, info.seq_len, info.dtype) == (1, 3, 4, "int32")


def test_an_index_that_is_not_utf8_or_json_is_one_line(home):
    split = home / "data" / "train"
    (split / "index.json").write_bytes(b'{"version": 2, "shards": [\xff]}')
    with pytest.raises(UserError, match=r"index.json: not UTF-8 text \(at byte offset 26\)"):
        mds_index.check(split)
    (split / "index.json").write_text('{"version": 2, "shards": 3}')
    with pytest.raises(UserError, match=r"index.json: expected an MDS index"):
        mds_index.check(split)


def test_train_refuses_a_crafted_dataset_in_one_line_before_it_starts(home):
    split, outside = home / "data" / "train", home / "elsewhere"
    index = _index(split)
    name = index["shards"][0]["raw_data"]["basename"]
    index["shards"][0]["raw_data"]["basename"] = f"../../elsewhere/{name}"
    shutil.move(split / name, outside / name)
    _write_index(split, index)
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "train", str(TINY), f"data.train={split}",
                           f"data.val={split}", f"run.dir={home / 'run'}"], capture_output=True, text=True,
                          env=env, cwd=home, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: data.train: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "shard 0: raw_data.basename" in proc.stderr
