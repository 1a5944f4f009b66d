"""`train.carry_state` through the engine (real DeepSpeed on 2 ranks, real MDS streams, the state
reset at documents' ends: train.reset_on_eos): a run resumed from its checkpoint, on the same world
size or on another with the same global batch, continues every stream from the state it was left
in and repeats the uninterrupted run's losses bit for bit (fp32)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpn_scale.storage.mds_datasets import reading
from gpn_scale.storage import safe_load
from gpn_scale.train.carry import rows
from support.mds_fixture import write_streams, write_windows
from support.train_runs import losses, samples, train
from support import ROOT, process_env

pytestmark = pytest.mark.slow
TOTAL = 8
STREAMS, WINDOWS, SEQ = 8, 5, 32  # 8 streams, 2 per slot: every slot moves to its second stream at step 6
EOS = 3
# Global batch 4 as 2 micro-batches (1 per rank on 2 ranks, 2 on 1 rank): two gradients sum to the same
# bits in either order, so the world sizes agree bit for bit (gradient clipping off: its global norm
# is summed per partition, in an order that follows the world size).
BATCH = ("train.carry_state=true", "train.reset_on_eos=true", "train.grad_accum=null", "train.global_batch=4", "train.micro_batch=2",
         "train.save_every=2", "train.keep_last=4", "train.grad_clip=0", "zero.stage=2", "eval.every=0",
         "eval.batches=100", f"train.total_steps={TOTAL}")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """OUT/streams/train with documents ending mid-window in every stream, and at each window's end in
    the even ones (the run resets the state there: train.reset_on_eos)."""
    root = tmp_path_factory.mktemp("prep") / "streams"
    for split in ("train", "val"):  # val: the same windows, scored by the run from the empty state
        write_streams(root / split, STREAMS, WINDOWS, SEQ, 512, eos=EOS)
    return root


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The uninterrupted 2-rank run, every second step checkpointed."""
    run = tmp_path_factory.mktemp("ref") / "run"
    train(data, run, 2, *BATCH)
    return run


def branch(reference: Path, run: Path, step: int) -> None:
    """The reference as it was at `step`: later checkpoints and records left out."""
    keep = f"step_{step:08d}"
    shutil.copytree(reference, run, ignore=lambda d, names: [n for n in names if Path(d).name == "checkpoints" and n != keep])
    for name in ("metrics.jsonl", "samples.jsonl"):
        rows = (run / name).read_text().splitlines()
        (run / name).write_text("".join(r + "\n" for r in rows if json.loads(r)["step"] <= step))


def test_validation_resets_the_state_at_eos_as_training_does(data, reference):
    """data.val (the streams' windows, each from the empty state) is scored with the resets: the
    run's val_loss is the final model's mean loss over every window read with them."""
    from gpn_scale.storage.mds_datasets import reading
    from gpn_scale.storage.checkpoints import load_model

    val = [json.loads(l) for l in (reference / "metrics.jsonl").read_text().splitlines() if "val_loss" in l]
    assert [r["step"] for r in val] == [TOTAL] and val[0]["val_tokens"] == STREAMS * WINDOWS * SEQ
    model = load_model(reference / "checkpoints" / f"step_{TOTAL:08d}")
    with reading(local=str(data / "val"), shuffle=False, batch_size=1) as ds:
        x = torch.stack([torch.from_numpy(ds[i]["tokens"].astype("int64")) for i in range(len(ds))])
    with torch.no_grad():
        reset = model(x, resets=x == EOS).token_losses.double().mean().item()
        carried = model(x).token_losses.double().mean().item()
    assert val[0]["val_loss"] == pytest.approx(reset, rel=1e-5)
    assert abs(carried - reset) > 100 * abs(val[0]["val_loss"] - reset)  # read without the resets, it is another loss


def test_checkpoints_hold_each_slot_block_and_the_stream_position(reference):
    tag = reference / "checkpoints" / "step_00000004"
    state = json.loads((tag / "trainer_state.json").read_text())
    assert state["loader"] == {"kind": "streams", "step": 4} and state["world_size"] == 2
    files = sorted(p.name for p in tag.glob("carry_slots_*.pt"))
    assert files == ["carry_slots_000000-000002.pt", "carry_slots_000002-000004.pt"]
    record = safe_load.load(tag / files[1])
    s, prev, M = record["state"]
    assert record["first_slot"] == 2 and s.shape[0] == M.shape[0] == 2 and s.dtype == torch.float32
    # slot 2 reads stream 2, whose windows end with EOS: it starts the next from the empty state;
    # slot 3's (stream 3) ends mid-document: a state the window left
    assert not torch.count_nonzero(s[0]) and not torch.count_nonzero(prev[0]) and not torch.count_nonzero(M[0])
    assert torch.count_nonzero(M[1]) > 0
    listed = json.loads((tag / "manifest.json").read_text())
    assert set(files) <= set(listed.get("files", listed))
    # each slot read its own stream, window after window: stream j at steps 1-5, then stream j + 4
    steps = samples(reference)
    assert [sorted(ids) for ids in steps[:2]] == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert sorted(steps[5]) == [4, 5, 6, 7]


def test_resume_on_the_same_world_size_is_bitwise(data, reference, tmp_path):
    run = tmp_path / "run"
    branch(reference, run, TOTAL // 2)
    train(data, run, 2, *BATCH, resume="auto")
    assert losses(run) == losses(reference) and sorted(losses(run)) == list(range(1, TOTAL + 1))
    assert samples(run) == samples(reference)


def test_resume_on_another_world_size_is_bitwise(data, reference, tmp_path):
    """From step 2 on one rank (each rank's block of slots now read by one), to the end."""
    run = tmp_path / "run"
    branch(reference, run, 2)
    proc = train(data, run, 1, *BATCH, resume="auto")
    assert "world size 2 -> 1: converting" in proc.stdout
    assert losses(run) == losses(reference)
    assert samples(run) == samples(reference)


def test_a_checkpoint_without_a_slots_state_is_refused(data, reference, tmp_path):
    run = tmp_path / "run"
    branch(reference, run, 2)
    (run / "checkpoints" / "step_00000002" / "carry_slots_000002-000004.pt").unlink()
    proc = train(data, run, 1, *BATCH, resume="auto", expect=2)
    assert "carry_slots_000002-000004.pt" in proc.stderr.strip().splitlines()[-1]


def _refusal(proc) -> str:
    """The run's one line: the last of stderr, and no traceback anywhere."""
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ")
    return last


def test_resuming_across_streams_and_shuffled_windows_is_one_line_either_way(data, reference, tmp_path):
    """A checkpoint's loader position is a step of the streams (with a state per slot) or an epoch of
    shuffled windows: resumed as the other kind, even with --allow-config-change, the run is refused in
    one line naming what the checkpoint holds and what would continue it."""
    windows = tmp_path / "windows"
    write_windows(windows / "train", 64, SEQ, 512)
    shuffled = ("train.carry_state=false", "train.reset_on_eos=false", f"data.train={windows / 'train'}")

    carried = tmp_path / "carried"  # a carried-state checkpoint, resumed on shuffled windows
    branch(reference, carried, 2)
    line = _refusal(train(data, carried, 1, *BATCH, *shuffled, "--allow-config-change", resume="auto", expect=2))
    assert "train.carry_state=true" in line and "step_00000002" in line, line

    plain = tmp_path / "plain"  # and the reverse: a shuffled-window checkpoint, resumed with carried state
    train(data, plain, 1, *BATCH, *shuffled, "train.total_steps=2")
    line = _refusal(train(data, plain, 1, *BATCH, "--allow-config-change", resume="auto", expect=2))
    assert "shuffled windows" in line and "train.carry_state=false" in line, line


def test_every_stream_is_read_from_the_empty_state_in_every_round(data, tmp_path):
    """A stream's last window ends where the prep's cut falls, mid-document (the odd streams here), so
    no state is carried from one stream into the next: at step 6 every slot starts its second stream
    (window 0 of streams 4-7) from the empty state, as in the first round, reset_on_eos or not."""
    from gpn_scale.storage.checkpoints import load_model

    run = tmp_path / "run"
    train(data, run, 1, *BATCH, "train.save_every=5", "train.total_steps=6")
    tag = run / "checkpoints" / "step_00000005"
    model = load_model(tag)
    with reading(local=str(data / "train"), shuffle=False, batch_size=1) as ds:
        x = torch.stack([torch.from_numpy(ds[i]["tokens"].astype("int64")) for i in (4, 5, 6, 7)])
    assert samples(run)[5] == [4, 5, 6, 7]
    carried = safe_load.load(tag / "carry_slots_000000-000004.pt")["state"]
    assert torch.count_nonzero(carried[2][1]) > 0  # slot 1 (stream 1) ended its last window mid-document
    with torch.no_grad():  # two micro-batches of two slots, as the run read them
        fresh = [model(x[m : m + 2], resets=x[m : m + 2] == EOS).loss.item() for m in (0, 2)]
        went_on = [model(x[m : m + 2], state=rows(carried, m, m + 2), resets=x[m : m + 2] == EOS).loss.item()
                   for m in (0, 2)]
    assert losses(run)[6] == pytest.approx(sum(fresh) / 2, rel=1e-6)
    assert abs(sum(went_on) / 2 - sum(fresh) / 2) > 1e-4  # the state it would otherwise have carried matters


@pytest.mark.parametrize("recipe", ["gpn_m_130m_1l_w256", "gpn_m_130m_1l_carried"])
def test_the_fast_recipes_train_at_tiny_size(recipe, data, tmp_path):
    """The paper's token batch in windows of 256 as shipped in configs/train: the prep command each
    names gives the paper's 262,144 tokens per step (in streams the carried one can read) in the data
    it reads; the fast recipe, the model and batch made tiny, trains and checkpoints (its keys: the
    global batch over micro-batches, bf16, ZeRO, the schedule), and the carried one is it with
    train.carry_state and the streams."""
    import yaml

    from gpn_scale.train.config import load_train_config

    path = ROOT / "configs" / "train" / f"{recipe}.yaml"
    text = path.read_text()
    seq_len = int(re.search(r"--seq-len (\d+)", text).group(1))
    cfg = load_train_config(path, [])
    assert cfg.train.global_batch * seq_len == 128 * 2048 and cfg.train.global_batch % (8 * cfg.train.micro_batch) == 0
    assert cfg.train.carry_state == (recipe == "gpn_m_130m_1l_carried")
    prep_out = Path(re.search(r"--out (\S+)", text).group(1))  # the data the recipe names is what its prep writes
    split = Path("streams", "train") if cfg.train.carry_state else Path("train")
    assert Path(cfg.data.train).parts[-len(prep_out.parts) - len(split.parts):] == (*prep_out.parts, *split.parts)
    assert Path(cfg.data.val).parts[-len(prep_out.parts) - 1:] == (*prep_out.parts, "val")
    if cfg.train.carry_state:  # the carried recipe differs from the trained one by the key and its data
        assert int(re.search(r"--streams (\d+)", text).group(1)) % cfg.train.global_batch == 0
        fast = load_train_config(path.with_name("gpn_m_130m_1l_w256.yaml"), [])
        assert dataclasses.replace(cfg.train, carry_state=False) == fast.train and cfg.model == fast.model
        return
    train_split = tmp_path / "windows" / "train"
    write_windows(train_split, 64, SEQ, 512)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "gpn_scale", "train", str(path), "model=gpn_m_tiny", f"run.dir={run}",
           f"data.train={train_split}", f"data.val={data / 'val'}", "train.global_batch=4", "train.micro_batch=2",
           "train.total_steps=2", "train.save_every=2", "eval.batches=1", "logging.wandb=disabled"]
    proc = subprocess.run(cmd, env=process_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["train"]["carry_state"] == cfg.train.carry_state and resolved["precision"] == "bf16"
    assert resolved["train"]["lr"] == 6e-4 and sorted(losses(run)) == [1, 2]
    assert (run / "checkpoints" / "step_00000002").is_dir()
