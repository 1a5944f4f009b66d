"""A run never runs foreign code. Every load of a checkpoint file, DeepSpeed's own included, goes
through torch's restricted unpickler with an allow-list; each pickle file must first be one plain
zip archive (no second directory that one zip reader sees and another does not); a manifest lists
exactly the files of its checkpoint.

One tiny 1-process run per ZeRO stage (stopped at step 1 of 2, so it can resume), copied per test.
The attack is built here from those real files: a zip whose end records lead torch's reader to a
second central directory, whose `data.pkl` runs a command (creating a marker file), while Python's
`zipfile` still finds the original members; the manifest is regenerated to match. Commands run as
a user runs them (`python -m gpn_scale ...` where DeepSpeed loads), and the marker must never appear.
"""

import contextlib
import functools
import itertools
import json
import os
import pickle
import random
import shutil
import socket
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from support.gadgets import directory_entries, plant_plain_pickle, plant_second_directory, plant_torch_save
from gpn_scale.storage import plain_zip, safe_load
from gpn_scale.storage.checkpoints import DERIVED, tag_for
from gpn_scale.cli import main
from gpn_scale.storage.native import add_manifest, save_native
from gpn_scale.train import checkpoint_writer as ckpt
from support.mds_fixture import write_windows
from support import ROOT

CONFIG = ROOT / "configs" / "train" / "gpn_m_tiny.yaml"
TAG = tag_for(1)


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")


def gpn_scale(*args, expect):
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", *map(str, args)], env=env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect, proc.stderr[-6000:]
    return proc


def train_args(data, run_dir, stage, *overrides):
    return ["train", CONFIG, f"run.dir={run_dir}", f"data.train={data / 'train'}", f"data.val={data / 'val'}",
            f"zero.stage={stage}", "train.total_steps=2", "eval.batches=1", *overrides]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run{stage}/ for ZeRO stages 0-3: one process, stopped (with a checkpoint) at step 1 of 2."""
    root = tmp_path_factory.mktemp("safe_load")
    write_windows(root / "data" / "train", 64, 32, 512)
    write_windows(root / "data" / "val", 8, 32, 512, seed=1)
    for stage in range(4):
        gpn_scale(*train_args(root / "data", root / f"run{stage}", stage, "train.stop_at_step=1"), expect=0)
    return root


def copy_run(runs, stage, tmp_path) -> Path:
    return Path(shutil.copytree(runs / f"run{stage}", tmp_path / "run"))


def reseal(tag_dir):
    """What a tamperer does: the manifest regenerated, so the files match it."""
    ckpt.write_manifest(tag_dir)


def assert_refused(proc, path, marker, why="not one plain zip archive"):
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-4000:]
    assert f"{path}: refusing to load" in errors[0] and why in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    assert not Path(marker).exists(), "the gadget ran"


# ---- what DeepSpeed and the trainer write passes, and the allow-list is exactly what it holds

def test_every_file_of_every_zero_stage_and_universal_form_passes_and_the_allow_list_is_what_they_hold(runs, tmp_path):
    named = set()
    for stage in range(4):
        tag_dir = runs / f"run{stage}" / "checkpoints" / TAG
        if stage in (1, 3):  # and the universal form of ZeRO 1-2 and of ZeRO-3
            tag_dir = Path(shutil.copytree(tag_dir, tmp_path / f"s{stage}" / TAG))
            ckpt.to_universal(tag_dir, workers=2 if stage == 3 else 1)  # forked workers load with the allow-list
        files = [p for p in tag_dir.rglob("*.pt")]
        assert len(files) >= 2
        for path in files:
            assert plain_zip.problem(path) is None, path
            assert safe_load.check_file(path) is None
            named |= set(torch.serialization.get_unsafe_globals_in_checkpoint(path))  # beyond torch's own list
        assert safe_load.checkpoint_problem(tag_dir, besides=DERIVED) is None  # as loaders check a checkpoint
        assert stage not in (1, 3) or safe_load.checkpoint_problem(tag_dir / ckpt.UNIVERSAL) is None
    assert named == set(safe_load.ALLOWED)  # RNG files of format 2 name no NumPy global


def test_the_attack_is_live_and_python_zipfile_does_not_see_it(runs, tmp_path):
    """What the attack does without the guard: Python's zipfile (the old scanner's reader) sees the
    original data.pkl, while torch.load(weights_only=False), as DeepSpeed calls it, runs the gadget.
    torch's restricted unpickler refuses the very same bytes."""
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    shutil.copy(runs / "run3" / "checkpoints" / TAG / path.name, path)
    original = plant_second_directory(path, tmp_path / "marker")
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None and z.read("archive/data.pkl") == original
    with pytest.raises(pickle.UnpicklingError, match="posix.system"):
        torch.load(path, weights_only=True)
    assert not (tmp_path / "marker").exists()
    torch.load(path, weights_only=False)
    assert (tmp_path / "marker").exists()


# ---- the attack at every ZeRO stage, through the CLI

PLANTED = {  # a file DeepSpeed loads on resume, at each stage
    0: "mp_rank_00_model_states.pt",
    1: "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    2: "mp_rank_00_model_states.pt",
    3: "zero_pp_rank_0_mp_rank_00_optim_states.pt",  # zero_to_fp32 (eval, generate, export) reads it too
}


@pytest.mark.parametrize("stage", sorted(PLANTED))
def test_a_second_directory_is_refused_by_verify_resume_and_conversion(runs, tmp_path, capsys, stage):
    run = copy_run(runs, stage, tmp_path)
    tag_dir = run / "checkpoints" / TAG
    planted, marker = tag_dir / PLANTED[stage], tmp_path / "marker"
    plant_second_directory(planted, marker)
    reseal(tag_dir)

    assert main(["ckpt", "verify", str(tag_dir)]) == 1
    out = capsys.readouterr().out
    assert f"{tag_dir}: {planted}: refusing to load: not one plain zip archive" in out, out
    proc = gpn_scale(*train_args(runs / "data", run, stage), "--resume", "auto", expect=2)
    assert_refused(proc, planted, marker)
    assert "resumed from" not in proc.stdout + proc.stderr
    assert_refused(gpn_scale("ckpt", "to-universal", tag_dir, expect=2), planted, marker)
    assert not (tag_dir / ckpt.UNIVERSAL).exists()  # DeepSpeed's conversion never started
    if stage == 3:  # the model is gathered by DeepSpeed's zero_to_fp32
        for command, *extra in (("eval", "--data", runs / "data" / "val", "--out", tmp_path / "eval"),
                                ("generate", "--prompt", "x", "--tokenizer", tmp_path / "none.json"),
                                ("export", "--to", "reference", "--out", tmp_path / "export")):
            assert_refused(gpn_scale(command, run, *extra, expect=2), planted, marker)
        assert not (tmp_path / "export").exists()


# ---- the guard itself: DeepSpeed's own loads, with the container check out of the way

def test_deepspeeds_own_loads_go_through_the_restricted_unpickler(runs, tmp_path):
    """The second directory planted where only DeepSpeed reads it, and DeepSpeed called directly
    (no check_file first): zero_to_fp32 and the worker processes of ds_to_universal refuse it inside
    `safe_load.restricted`; zero_to_fp32 outside it runs it. (engine.load_checkpoint: in
    tests/train/test_train_parts.py, beside the process group a DeepSpeed engine needs.)"""
    from deepspeed.checkpoint.ds_to_universal import _do_parallel_work
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    marker = tmp_path / "marker"
    tag_dir = Path(shutil.copytree(runs / "run3" / "checkpoints" / TAG, tmp_path / "ds3" / TAG))
    planted = tag_dir / PLANTED[3]
    plant_second_directory(planted, marker)
    with pytest.raises(safe_load.UserError, match="posix.system"), safe_load.restricted(tag_dir):
        get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=TAG)
    # ds_to_universal's worker processes, started as it starts them, asking for an unrestricted load
    with pytest.raises(safe_load.UserError, match="posix.system"), safe_load.restricted(tag_dir):
        _do_parallel_work(functools.partial(torch.load, weights_only=False), [planted, planted], 2)
    assert not marker.exists()
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None  # the scope is left as found
    with contextlib.suppress(Exception):  # unrestricted, DeepSpeed's own load runs it (then fails on what it built)
        get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=TAG)
    assert marker.exists()


# ---- the container check on its own

def _torch_file(tmp_path) -> bytes:
    torch.save({"a": torch.arange(5.0), "b": [torch.ones(3), 7]}, tmp_path / "plain.pt")
    return (tmp_path / "plain.pt").read_bytes()


def _python_zip(*members) -> bytes:
    import io

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a duplicate name: what one case is about
        for name, data in members:
            z.writestr(name, data)
    return buffer.getvalue()


def test_only_one_plain_zip_passes_the_container_check(tmp_path):
    data = _torch_file(tmp_path)
    z64 = struct.unpack_from("<Q", data, len(data) - 42 + 8)[0]
    cd_size, cd_offset = struct.unpack_from("<QQ", data, z64 + 40)
    entries = [pos for pos, _ in directory_entries(data[cd_offset:cd_offset + cd_size])]

    def with_field(at, fmt, value):
        out = bytearray(data)
        struct.pack_into(fmt, out, at, value)
        return bytes(out)

    second = struct.unpack_from("<I", data, cd_offset + entries[1] + 42)[0]
    cases = {
        "data appended": data + b"\0",
        "a byte prepended": b"\0" + data,
        "a second zip appended": data + _python_zip(("archive/data.pkl", b"x")),
        "a second zip prepended": _python_zip(("archive/data.pkl", b"x")) + data,
        "a comment": data[:-2] + struct.pack("<H", 1) + b"x",
        "overlapping members": with_field(cd_offset + entries[1] + 42, "<I", 0),  # where the first one starts
        "a gap between members": with_field(cd_offset + entries[1] + 42, "<I", second + 1),
        "a size that disagrees": with_field(cd_offset + entries[0] + 20, "<I", 1 + struct.unpack_from(
            "<I", data, cd_offset + entries[0] + 20)[0]),
        "a compressed member": with_field(cd_offset + entries[0] + 10, "<H", 8),
        "a local name that disagrees": data[:30] + b"X" + data[31:],
        "end records that disagree": with_field(len(data) - 22 + 16, "<I", cd_offset + 1),
        "a truncated file": data[:-1],
        "a duplicated member": _python_zip(("archive/data.pkl", b"x"), ("archive/data.pkl", b"y")),
        "not a zip": pickle.dumps({"a": 1}),
    }
    assert plain_zip.problem(tmp_path / "plain.pt") is None
    for what, bad in cases.items():
        (tmp_path / "bad.pt").write_bytes(bad)
        assert plain_zip.problem(tmp_path / "bad.pt") is not None, what
        assert "not one plain zip" in safe_load.check_file(tmp_path / "bad.pt"), what
    # what other writers of plain zips produce passes: no data descriptor, forced zip64 headers
    with zipfile.ZipFile(tmp_path / "py.pt", "w") as z:
        z.writestr("archive/data.pkl", b"x" * 10)
        with z.open("archive/data/0", "w", force_zip64=True) as member:
            member.write(b"y" * 100)
    assert plain_zip.problem(tmp_path / "py.pt") is None


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")
def test_other_formats_and_gadgets_in_one_plain_zip_are_refused(tmp_path):
    """TorchScript (torch.load hands it to torch.jit.load), tar and plain pickles (torch's older
    formats) are refused by the container check; a gadget inside one plain zip by torch's listing
    of what the pickle names, before the restricted unpickler, which refuses it too."""
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "scripted.pt")
    assert "not one plain zip" in safe_load.check_file(tmp_path / "scripted.pt")  # its members are compressed
    with pytest.raises(RuntimeError, match="TorchScript"), safe_load.restricted(tmp_path):
        torch.load(tmp_path / "scripted.pt", weights_only=False)
    import tarfile

    with tarfile.open(tmp_path / "old.pt", "w") as tar:
        tar.add(tmp_path / "scripted.pt", arcname="pickle")
    assert "not one plain zip" in safe_load.check_file(tmp_path / "old.pt")
    plant_plain_pickle(tmp_path / "plain.pt", tmp_path / "marker")
    assert "not one plain zip" in safe_load.check_file(tmp_path / "plain.pt")
    plant_torch_save(tmp_path / "gadget.pt", tmp_path / "marker")
    assert "names posix.system, which no checkpoint of this system holds" in safe_load.check_file(tmp_path / "gadget.pt")
    with pytest.raises(safe_load.UserError, match="posix.system"), safe_load.restricted(tmp_path):
        torch.load(tmp_path / "gadget.pt", weights_only=False)  # the caller's choice is overridden
    assert not (tmp_path / "marker").exists()


def test_a_directory_linked_into_a_checkpoint_from_outside_is_refused_before_any_file_is_read(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    plant_torch_save(tmp_path / "elsewhere" / "fp32.pt", tmp_path / "marker")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "zero").symlink_to(tmp_path / "elsewhere")
    problem = safe_load.checkpoint_problem(tmp_path / "ckpt")
    assert problem == f"{tmp_path / 'ckpt'}: zero is a symlink to {tmp_path / 'elsewhere'}, outside {tmp_path / 'ckpt'}"
    assert not (tmp_path / "marker").exists()


# ---- refusals of other plantings, through the CLI

@pytest.mark.parametrize("command, stage, name, plant", [
    ("eval", 2, "mp_rank_00_model_states.pt", plant_torch_save),  # the file eval loads itself
    ("generate", 0, "rng_rank0.pt", plant_plain_pickle),  # a file it never loads: every pickle file is checked
    ("analyze", 3, "zero_pp_rank_0_mp_rank_00_optim_states.pt", plant_second_directory),  # zero_to_fp32's
])
def test_eval_generate_and_analyze_refuse_a_planted_gadget(runs, tmp_path, command, stage, name, plant):
    run = copy_run(runs, stage, tmp_path)
    tag_dir = run / "checkpoints" / TAG
    marker = tmp_path / "marker"
    plant(tag_dir / name, marker)
    reseal(tag_dir)
    extra = {"eval": ["--data", runs / "data" / "val", "--out", tmp_path / "out"],
             "generate": ["--prompt", "x", "--tokenizer", tmp_path / "none.json"],
             "analyze": ["--data", runs / "data" / "val", "--out", tmp_path / "out"]}[command]
    proc = gpn_scale(command, run, *extra, expect=2)
    assert_refused(proc, tag_dir / name, marker, why="posix.system" if plant is plant_torch_save else "plain zip")


def test_a_planted_universal_form_is_refused_where_it_is_used(runs, tmp_path, capsys):
    run = copy_run(runs, 2, tmp_path)
    tag_dir = run / "checkpoints" / TAG
    assert main(["ckpt", "to-universal", str(tag_dir)]) == 0
    planted = next((tag_dir / ckpt.UNIVERSAL / "zero").iterdir()) / "fp32.pt"
    marker = tmp_path / "marker"
    plant_second_directory(planted, marker)
    reseal(tag_dir / ckpt.UNIVERSAL)
    capsys.readouterr()
    assert main(["ckpt", "verify", str(tag_dir)]) == 1
    assert f"{tag_dir}: universal/: {planted}: refusing to load" in capsys.readouterr().out
    assert main(["ckpt", "to-universal", str(tag_dir)]) == 2  # reusing it: checked first
    assert f"error: {planted}: refusing to load" in capsys.readouterr().err
    # resumed on 2 ranks, the run reuses it: refused on rank 0 before any rank loads, and every rank
    # stops (none waits for the others at a barrier)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), "-m", "gpn_scale", *map(str, train_args(runs / "data", run, 2)),
                           "train.grad_accum=1", "--resume", "auto"],
                          env=env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert f"error: {planted}: refusing to load" in proc.stderr, proc.stderr[-3000:]
    assert "resumed from" not in proc.stdout + proc.stderr and not marker.exists()


# ---- what is not tampered with still loads

def test_an_untouched_checkpoint_resumes_and_evaluates_and_an_old_rng_file_still_loads(runs, tmp_path):
    run = copy_run(runs, 2, tmp_path)
    tag_dir = run / "checkpoints" / TAG
    # the RNG format 1, as checkpoints written before format 2 hold it
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               tag_dir / "rng_rank0.pt")
    ckpt.write_manifest(tag_dir)
    assert safe_load.check_file(tag_dir / "rng_rank0.pt") is None
    shutil.copy(tag_dir / "rng_rank0.pt", tmp_path / "mp_rank_00_model_states.pt")  # NumPy's globals only in RNG files
    assert "numpy" in safe_load.check_file(tmp_path / "mp_rank_00_model_states.pt")
    proc = gpn_scale(*train_args(runs / "data", run, 2), "--resume", "auto", expect=0)
    assert f"resumed from {tag_dir} at step 1" in proc.stdout
    proc = gpn_scale("eval", run, "--data", runs / "data" / "val", "--json", "--out", tmp_path / "out", expect=0)
    assert json.loads(proc.stdout.splitlines()[-1])["windows"] == 8


def test_rng_format_2_restores_every_generator(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    ckpt.save_rng(tmp_path, 0)
    first = random.random(), np.random.randn(), torch.randn(2).tolist()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert ckpt.load_rng(tmp_path, 0)
    assert (random.random(), np.random.randn(), torch.randn(2).tolist()) == first
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "rng_rank0.pt") == []


# ---- manifests: every file listed, every listed file there

def test_verify_fails_a_manifest_that_does_not_list_every_file_and_checks_a_run_directory(runs, tmp_path, capsys):
    run = copy_run(runs, 2, tmp_path)
    tag_dir = run / "checkpoints" / TAG
    assert main(["ckpt", "verify", str(run)]) == 0  # a run directory: each of its checkpoints
    assert capsys.readouterr().out.strip() == f"{tag_dir}: ok"
    manifest_file = tag_dir / "manifest.json"
    good = manifest_file.read_text()
    weights = tag_dir / "mp_rank_00_model_states.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a damaged weight, and a manifest that lists nothing
    weights.write_bytes(bytes(data))
    manifest_file.write_text(json.dumps({"files": {}}))
    for path in (run, run / "checkpoints", tag_dir):
        assert main(["ckpt", "verify", str(path)]) == 1
        assert "mp_rank_00_model_states.pt (and 3 more) is there but not listed in manifest.json" in capsys.readouterr().out
    assert main(["eval", str(run), "--data", str(runs / "data" / "val"), "--out", str(tmp_path / "eval")]) == 2
    assert "no complete training checkpoint there" in capsys.readouterr().err
    assert not (tmp_path / "eval").exists()

    manifest_file.write_text(good)
    (tag_dir / "notes.txt").write_text("added")
    assert main(["ckpt", "verify", str(tag_dir)]) == 1
    assert "notes.txt is there but not listed" in capsys.readouterr().out
    (tag_dir / "notes.txt").unlink()
    listed = json.loads(good)
    listed["files"]["zero_pp_rank_1_mp_rank_00_optim_states.pt"] = {"bytes": 1, "xxh3_128": "0"}
    manifest_file.write_text(json.dumps(listed))
    assert main(["ckpt", "verify", str(tag_dir)]) == 1
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in capsys.readouterr().out
    assert main(["ckpt", "verify", str(tmp_path / "nothing")]) == 2


def test_the_universal_form_and_native_checkpoints_list_every_file_too(runs, tmp_path, capsys):
    run = copy_run(runs, 1, tmp_path)
    tag_dir = run / "checkpoints" / TAG
    assert main(["ckpt", "to-universal", str(tag_dir)]) == 0
    assert main(["ckpt", "verify", str(tag_dir)]) == 0  # the universal form beside the tag's files: ok
    universal = tag_dir / ckpt.UNIVERSAL
    (universal / "manifest.json").write_text(json.dumps({"files": {}}))
    capsys.readouterr()
    assert main(["ckpt", "verify", str(tag_dir)]) == 1
    assert "universal/: " in capsys.readouterr().out
    # a damaged universal form is converted again from the checkpoint, not loaded
    assert main(["ckpt", "to-universal", str(tag_dir)]) == 0
    assert main(["ckpt", "verify", str(tag_dir)]) == 0


def test_native_checkpoint_manifest_is_checked(tmp_path, capsys):
    from support.eval_fixtures import tiny_model

    ckpt_dir = save_native(tiny_model(64), tmp_path / "native")
    write_windows(tmp_path / "val", 2, 16, 64)
    outs = itertools.count()  # each evaluation into a new --out: eval overwrites nothing

    def args():
        return ["eval", str(ckpt_dir), "--data", str(tmp_path / "val"), "--out", str(tmp_path / f"out{next(outs)}")]

    assert main(args()) == 0

    weights = ckpt_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of a weight
    weights.write_bytes(bytes(data))
    assert main(args()) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: {ckpt_dir}: model.safetensors does not match its xxh3_128 hash (corrupted)"]

    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    (ckpt_dir / "extra.bin").write_bytes(b"added")
    assert main(args()) == 2
    assert "extra.bin is there but not listed in manifest.json" in capsys.readouterr().err
    (ckpt_dir / "manifest.json").write_text(json.dumps({"files": {}}))
    assert main(args()) == 2
    assert "does not list model.safetensors" in capsys.readouterr().err

    # written before native checkpoints had a manifest: loads, with one warning line
    (ckpt_dir / "extra.bin").unlink()
    (ckpt_dir / "manifest.json").unlink()
    assert main(args()) == 0
    warnings = [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning:")]
    assert len(warnings) == 1 and "has no manifest.json" in warnings[0]
    add_manifest(ckpt_dir)
    assert main(args()) == 0
    assert "warning" not in capsys.readouterr().err


# ---- symlinks out of a checkpoint

def test_a_checkpoint_file_linked_to_outside_is_refused_by_verify_resume_and_eval(runs, tmp_path, capsys):
    run = copy_run(runs, 2, tmp_path)
    tag_dir = run / "checkpoints" / TAG
    weights = tag_dir / "mp_rank_00_model_states.pt"
    outside = tmp_path / "elsewhere.pt"
    shutil.move(weights, outside)
    weights.symlink_to(outside)
    reseal(tag_dir)  # the manifest lists the link's target bytes: only the link itself is wrong
    assert main(["ckpt", "verify", str(tag_dir)]) == 1
    assert f"mp_rank_00_model_states.pt is a symlink to {outside}, outside {tag_dir}" in capsys.readouterr().out
    assert main(["eval", str(run), "--data", str(runs / "data" / "val"), "--out", str(tmp_path / "eval")]) == 2
    assert "no complete training checkpoint there" in capsys.readouterr().err
    assert safe_load.checkpoint_problem(tag_dir, besides=DERIVED).endswith(f"outside {tag_dir}")
    # a link to a directory that holds it: a loader would walk it forever
    weights.unlink()
    shutil.move(outside, weights)
    (tag_dir / "loop").symlink_to(tag_dir)
    assert main(["ckpt", "verify", str(tag_dir)]) == 1
    assert f"loop is a symlink to {tag_dir.resolve()}, a directory that holds it" in capsys.readouterr().out
    (tag_dir / "loop").unlink()
    outside = tmp_path / "elsewhere.pt"
    shutil.move(weights, outside)
    # a link inside the checkpoint is one of its files
    shutil.move(outside, tag_dir / "weights.real")
    weights.symlink_to(tag_dir / "weights.real")
    reseal(tag_dir)
    assert main(["ckpt", "verify", str(tag_dir)]) == 0


def test_a_native_checkpoint_or_export_linked_to_outside_is_refused_with_or_without_a_manifest(tmp_path, capsys):
    from support.eval_fixtures import tiny_model

    ckpt_dir = save_native(tiny_model(64), tmp_path / "native")
    write_windows(tmp_path / "val", 2, 16, 64)
    weights = ckpt_dir / "model.safetensors"
    shutil.move(weights, tmp_path / "outside.safetensors")
    weights.symlink_to(tmp_path / "outside.safetensors")
    for manifest_there in (True, False):
        if manifest_there:
            add_manifest(ckpt_dir)
        else:
            (ckpt_dir / "manifest.json").unlink()
        assert main(["eval", str(ckpt_dir), "--data", str(tmp_path / "val"), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == (f"error: {ckpt_dir}: model.safetensors is a symlink to {tmp_path / 'outside.safetensors'}, "
                           f"outside {ckpt_dir}"), err
        assert not (tmp_path / "out").exists()
