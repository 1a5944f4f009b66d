"""A run never runs foreign code: a gadget planted in any file of a checkpoint (its manifest
regenerated, so the hashes match) is refused with one line naming the file and the global, by
`train --resume`, `eval`, `generate`, `analyze` and `ckpt to-universal`, and nothing runs.

One tiny 1-process run per ZeRO stage (stopped at step 1 of 2, so it can resume), copied per test;
every refusal is a real `python -m gpn_scale ...` process, and each test checks that the gadget's
marker file was not created.
"""

import contextlib
import json
import os
import pickle
import random
import shlex
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from gpn_scale import safe_load
from gpn_scale.cli import main
from gpn_scale.checkpoints import tag_for
from gpn_scale.native import add_manifest, save_native
from gpn_scale.train import checkpoint as ckpt
from mds_fixture import write_windows

ROOT = Path(__file__).resolve().parent.parent
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


# ---- gadgets: unpickling any of them creates `marker` through os.system, as an attack would run a command

class Gadget:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def memo_pickle(marker) -> bytes:
    """Protocol 4 whose STACK_GLOBAL finds `posix` and `system` only through the memo: pushed,
    memoised (MEMOIZE), popped, then fetched again (BINGET)."""
    def text(s):
        b = s.encode()
        return b"X" + struct.pack("<I", len(b)) + b  # BINUNICODE

    command = f"touch {shlex.quote(str(marker))}"
    return (b"\x80\x04" + text("posix") + b"\x94" + text("system") + b"\x94" + b"00"
            + b"h\x00h\x01\x93" + text(command) + b"\x85R.")


def plant_torch_save(path, marker, protocol=2):
    """A torch.save file (zip) with a gadget beside ordinary tensors: GLOBAL (2) or STACK_GLOBAL (4)."""
    torch.save({"module": {"w": torch.zeros(2)}, "extra": Gadget(marker)}, path, pickle_protocol=protocol)


def plant_in_zip(path, marker):
    """The same zip archive, its data.pkl replaced by `memo_pickle`."""
    members = {}
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            members[info.filename] = z.read(info)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, memo_pickle(marker) if name.endswith("/data.pkl") else data)


def plant_plain_pickle(path, marker):
    """Not a zip: torch.load's legacy path unpickles it (as the magic number) straight away."""
    Path(path).write_bytes(pickle.dumps(Gadget(marker), protocol=5))


def reseal(tag_dir):
    """What a tamperer does: the manifest regenerated, so the files match it."""
    ckpt.write_manifest(tag_dir)


def assert_refused(proc, path, marker, global_name="posix.system"):
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-4000:]
    assert f"{path}: refusing to load" in errors[0] and global_name in errors[0], errors[0]
    assert "Traceback" not in proc.stderr
    assert not Path(marker).exists(), "the gadget ran"


# ---- the scanner against what DeepSpeed and the trainer write

def test_every_file_of_every_zero_stage_passes_and_the_allow_list_is_exactly_what_they_hold(runs):
    found = set()
    for stage in range(4):
        tag_dir = runs / f"run{stage}" / "checkpoints" / TAG
        assert safe_load.scan_checkpoint(tag_dir) is None
        for path in tag_dir.iterdir():
            assert safe_load.scan_file(path, found) is None
    # Only checkpoints of the RNG format 1 (NumPy's state tuple) name the rest.
    old_rng = {"numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.ndarray",
               "numpy.dtype", "_codecs.encode"}
    assert found == set(safe_load.ALLOWED) - old_rng


def test_the_gadgets_are_live(tmp_path):
    """Each planting runs its gadget under an unrestricted torch.load, as DeepSpeed's loads are."""
    for i, plant in enumerate([plant_torch_save, lambda p, m: plant_torch_save(p, m, 4), plant_plain_pickle]):
        marker = tmp_path / f"marker{i}"
        plant(tmp_path / f"f{i}.pt", marker)
        with contextlib.suppress(RuntimeError):  # the plain pickle is read as the magic number: it runs, then fails
            torch.load(tmp_path / f"f{i}.pt", weights_only=False)
        assert marker.exists()
    torch.save({"w": torch.zeros(2)}, tmp_path / "z.pt")
    plant_in_zip(tmp_path / "z.pt", tmp_path / "marker_zip")
    torch.load(tmp_path / "z.pt", weights_only=False)
    assert (tmp_path / "marker_zip").exists()


def test_scanner_follows_the_memo_and_refuses_what_it_cannot_name():
    assert safe_load.pickle_globals(memo_pickle("m"))[0] == ["posix.system"]
    computed = b"\x80\x04\x88\x8c\x06system\x93."  # STACK_GLOBAL's module is a bool, not a string
    assert safe_load.pickle_globals(computed)[0] == [safe_load.COMPUTED]
    dotted = b"\x80\x04\x8c\x05torch\x8c\x19_utils._rebuild_tensor_v2\x93."  # an attribute path
    assert safe_load.pickle_globals(dotted)[0][0] not in safe_load.ALLOWED
    assert safe_load.pickle_globals(b"(S'x'\nios\nsystem\n.")[0] == ["os.system"]  # protocol 0's INST
    assert safe_load.pickle_globals(b'{"step": 1}')[0] == []  # JSON is not a pickle


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")
def test_archives_torch_load_would_run_otherwise_and_linked_directories(tmp_path):
    """TorchScript (torch.load hands it to torch.jit.load) and tar (torch's oldest format) are
    refused; a directory linked into a checkpoint is scanned like one inside it."""
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "scripted.pt")
    assert "TorchScript archive" in safe_load.scan_file(tmp_path / "scripted.pt")
    import tarfile

    with tarfile.open(tmp_path / "old.pt", "w") as tar:
        tar.add(tmp_path / "scripted.pt", arcname="pickle")
    assert "tar archive" in safe_load.scan_file(tmp_path / "old.pt")
    (tmp_path / "elsewhere").mkdir()
    plant_plain_pickle(tmp_path / "elsewhere" / "fp32.pt", tmp_path / "marker")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "universal").symlink_to(tmp_path / "elsewhere")
    problem = safe_load.scan_checkpoint(tmp_path / "ckpt")
    assert f"{tmp_path / 'ckpt' / 'universal' / 'fp32.pt'}: refusing to load" in problem and "posix.system" in problem


# ---- refusals, through the CLI

RESUME_PLANTS = {  # a different file, and way of pickling, at each stage
    0: ("mp_rank_00_model_states.pt", plant_torch_save),
    1: ("zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda p, m: plant_torch_save(p, m, 4)),
    2: ("rng_rank0.pt", plant_plain_pickle),
    3: ("zero_pp_rank_0_mp_rank_00_model_states.pt", plant_in_zip),
}


@pytest.mark.parametrize("stage", sorted(RESUME_PLANTS))
def test_resume_refuses_a_planted_gadget(runs, tmp_path, stage):
    run = copy_run(runs, stage, tmp_path)
    tag_dir = run / "checkpoints" / TAG
    name, plant = RESUME_PLANTS[stage]
    marker = tmp_path / "marker"
    plant(tag_dir / name, marker)
    reseal(tag_dir)
    proc = gpn_scale(*train_args(runs / "data", run, stage), "--resume", "auto", expect=2)
    assert_refused(proc, tag_dir / name, marker)
    assert "resumed from" not in proc.stdout


@pytest.mark.parametrize("command, stage, name, plant", [
    ("eval", 2, "mp_rank_00_model_states.pt", plant_torch_save),  # the file eval loads itself
    ("generate", 0, "rng_rank0.pt", plant_plain_pickle),  # a file it never loads: every file is scanned
    ("analyze", 3, "zero_pp_rank_0_mp_rank_00_optim_states.pt", plant_in_zip),  # read by DeepSpeed's zero_to_fp32
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
    assert_refused(proc, tag_dir / name, marker)


def test_universal_conversion_and_its_output_are_scanned(runs, tmp_path):
    run = copy_run(runs, 2, tmp_path)
    tag_dir = run / "checkpoints" / TAG
    source = tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    clean = source.read_bytes()
    marker = tmp_path / "marker"
    plant_torch_save(source, marker, 4)
    reseal(tag_dir)
    assert_refused(gpn_scale("ckpt", "to-universal", tag_dir, expect=2), source, marker)
    assert not (tag_dir / ckpt.UNIVERSAL).exists()  # DeepSpeed's conversion never started

    source.write_bytes(clean)
    reseal(tag_dir)
    gpn_scale("ckpt", "to-universal", tag_dir, expect=0)
    planted = next((tag_dir / ckpt.UNIVERSAL / "zero").iterdir()) / "fp32.pt"
    plant_in_zip(planted, marker)
    reseal(tag_dir / ckpt.UNIVERSAL)
    proc = gpn_scale(*train_args(runs / "data", run, 2), "--resume", "auto", expect=2)
    assert_refused(proc, planted, marker)


# ---- what is not tampered with still loads

def test_an_untouched_checkpoint_resumes_and_evaluates_and_an_old_rng_file_still_loads(runs, tmp_path):
    run = copy_run(runs, 2, tmp_path)
    tag_dir = run / "checkpoints" / TAG
    # the RNG format 1, as checkpoints written before format 2 hold it
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               tag_dir / "rng_rank0.pt")
    ckpt.write_manifest(tag_dir)
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
    found = set()
    assert safe_load.scan_file(tmp_path / "rng_rank0.pt", found) is None
    assert not any(name.startswith("numpy") for name in found)


# ---- native checkpoints: the same manifest check

def test_native_checkpoint_manifest_is_checked(tmp_path, capsys):
    from eval_fixtures import tiny_model

    ckpt_dir = save_native(tiny_model(64), tmp_path / "native")
    write_windows(tmp_path / "val", 2, 16, 64)
    outs = iter(range(4))  # each evaluation into a new --out: eval overwrites nothing

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

    # written before native checkpoints had a manifest: loads, with one warning line
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    (ckpt_dir / "manifest.json").unlink()
    assert main(args()) == 0
    warnings = [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning:")]
    assert len(warnings) == 1 and "has no manifest.json" in warnings[0]
    add_manifest(ckpt_dir)
    assert main(args()) == 0
    assert "warning" not in capsys.readouterr().err
