"""`gpn-scale train CONFIG [key=value ...] [--resume auto|none|DIR] [--branch-from CKPT]`: DeepSpeed ZeRO training.

One step = `grad_accum` micro-batches per rank, then one AdamW update (DeepSpeed, ZeRO stage 0-3).
Precision `bf16` runs the forward and backward under torch autocast while the master weights,
the optimiser, the recurrent state and the memory stay float32.

Exit status: 0 when the run reached `train.total_steps` or `train.stop_at_step`;
75 (EX_TEMPFAIL) when SIGTERM or SIGUSR1 made it checkpoint and stop early: launchers requeue
on it and resume with `--resume auto`; 130 when SIGINT (Ctrl-C) did the same (a second SIGINT
aborts at once, without a checkpoint); 3 when the loss or gradient norm stopped being finite
(no checkpoint of the non-finite state is written); 2 for bad input. The same outcome is written
to `run.dir/status.json` (`running`, `preempted`, `interrupted`, `diverged` or `finished`, with
the step), for launchers that cannot see the trainer's exit status (torchrun reports any
non-zero worker exit as 1; the project's launchers pass a refusal's 2 on: gpn_scale/train/torchrun.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import yaml

from gpn_scale.storage import atomic, checkpoints, safe_load
from gpn_scale.config import resolve_config_path
from data_prep.errors import UserError
from data_prep.helptext import HelpFormatter
from gpn_scale.storage.jsonl import JsonLines, truncate_jsonl
from data_prep.lock import RunLock
from gpn_scale.train import checkpoint_writer as ckpt
from gpn_scale.train import distributed as dist_utils
from gpn_scale.train import loop, optim, preflight, profiling
from gpn_scale.train import branch
from gpn_scale.train.config import (BRANCHABLE, RESUMABLE, TrainConfig, config_changes, load_train_config,
                                    resolve_train_config, sources)
from gpn_scale.train.gc import GarbageCollection
from gpn_scale.train.loop import Audit, Outcome
from gpn_scale.train.metrics import (MetricsLog, RunClock, RunSummary, StepMetrics, flops_per_token, peak_flops,
                                     peak_memory_bytes, summary_line)
from kernels.graph import graphs_of

EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130
EXIT_DIVERGED = 3


def grad_accum_for(cfg: TrainConfig, world_size: int) -> int:
    t = cfg.train
    if t.global_batch is None:
        return t.grad_accum or 1
    per_step = t.micro_batch * world_size
    if t.global_batch % per_step:
        raise UserError(
            f"train.global_batch: {t.global_batch} is not a multiple of micro_batch x world size "
            f"({t.micro_batch} x {world_size})"
        )
    return t.global_batch // per_step


def deepspeed_config(cfg: TrainConfig, grad_accum: int, universal: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": {"stage": cfg.zero.stage},
        "zero_allow_untested_optimizer": True,  # torch's AdamW: the same update on every device type
        "checkpoint": {"load_universal": universal},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


class Trainer:
    def __init__(self, cfg: TrainConfig, resume: str, data: preflight.DataInfo | None = None,
                 allow_config_change: bool = False, branch_from: str | None = None):
        self.launched = time.monotonic()
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.data_info = data
        self.rank, self.world, _ = dist_utils.init()
        self.is_main = self.rank == 0
        self.device = dist_utils.device()
        self.stop_flag = dist_utils.StopFlag()
        try:
            self.grad_accum = grad_accum_for(cfg, self.world)
        except UserError as e:
            e.every_rank = True
            raise
        self.global_batch = cfg.train.micro_batch * self.grad_accum * self.world
        self.config_changes: list[tuple] = []  # (key, checkpoint's value, this run's), applied on resume
        # where this launch starts from another run's checkpoint (a decay branch): that checkpoint
        self.origin: branch.Origin | None = None
        # What _build makes (the model, DeepSpeed and the data, then the checkpoint resumed from loaded):
        self.model: torch.nn.Module | None = None
        self.engine = None  # DeepSpeed's engine around self.model: forward, backward, step, save
        self.scheduler = None  # the learning-rate schedule DeepSpeed steps with the optimiser
        self.data = None  # the training batches: ShuffledBatches, or StreamBatches with train.carry_state
        self.carried = None  # with train.carry_state: each batch slot's recurrent state (CarriedStates)
        self.step: int | None = None  # optimiser steps taken: 0, or the checkpoint's
        self.tokens: int | None = None  # tokens trained on, as step
        # What _start sets up for this launch:
        self.stop_at: int | None = None  # the step it trains to: train.stop_at_step, else train.total_steps
        self.start_step: int | None = None  # the step and tokens it started from, for its summary
        self.start_tokens: int | None = None
        self.last_loss: float | None = None  # its latest step's loss, for its summary
        self.last_eval: dict | None = None  # its latest evaluation's results, with their step
        self.step_seconds = 0.0  # the time its steps took
        self.audit: Audit | None = None  # stops the run when the loss or gradient norm stays non-finite
        self.clock: RunClock | None = None  # elapsed time and the ETA in the progress lines
        self.peak_flops: float | None = None  # one device's, for the MFU (None: unknown, no MFU)
        self.profiler: profiling.StepProfiler | None = None
        self.snapshots: profiling.MemorySnapshots | None = None
        self.log: MetricsLog | None = None  # metrics.jsonl, wandb, TensorBoard and the progress lines
        self.samples_file: JsonLines | None = None  # rank 0's samples.jsonl, with data.log_sample_ids
        self.step_samples: list[int] = []  # this rank's sample ids in the step being trained
        self._val: dict | None = None  # data.val's windows by source name (ValWindows), read at the first evaluation
        self.resume_dir = self._choose_resume(resume, allow_config_change, branch_from)
        # Checkpoints rank 0 has verified or written: rotation does not hash them again at each save.
        own = self.resume_dir is not None and self.origin is None
        self.verified: set[str] = {self.resume_dir.name} if own else set()

    # ---- setup ---------------------------------------------------------------------------------

    def _say(self, message: str) -> None:
        """A line of the run's report (its start, resume, end) on rank 0's stdout: with DeepSpeed's log
        and the progress, where `| tee` and SLURM's output file keep it."""
        if not self.is_main:
            return
        if self.log is not None:
            self.log.write(message)
        else:
            print(message, flush=True)

    def _warn(self, message: str) -> None:
        """A warning or an error, on rank 0's stderr."""
        if self.is_main:
            print(message, file=sys.stderr, flush=True)

    def _choose_resume(self, resume: str, allow_config_change: bool, branch_from: str | None) -> Path | None:
        """The checkpoint directory to start from (agreed by all ranks): the run's own, another run's
        (a decay branch starting: `self.origin`), or None for a fresh start (`--resume auto` only
        where there is no checkpoint at all: one that exists but cannot be used is an error, never a
        silent restart from step 0)."""
        choice = None
        if self.is_main:
            try:
                choice = self._resume_choice(resume, allow_config_change, branch_from)
            except UserError as e:
                choice = e
        choice, self.config_changes, self.origin = dist_utils.broadcast_object(
            (choice, self.config_changes, self.origin))
        if isinstance(choice, UserError):
            choice.every_rank = True  # rank 0's, raised by all
            raise choice
        return choice

    def _resume_choice(self, resume: str, allow_config_change: bool, branch_from: str | None) -> Path | None:
        if resume == "none":
            return None
        if resume == "auto":
            recorded = branch.read_origin(self.run_dir)  # this run.dir is a decay branch: where it started
            rejected = []
            tag = checkpoints.newest_complete(self.ckpt_root, warn=self._warn, rejected=rejected)
            if tag is None and rejected:
                listed = "; ".join(f"{t}: {why}" for t, why in rejected)
                raise UserError(f"--resume auto: no checkpoint in {self.ckpt_root} can be resumed from ({listed}); "
                                "restore one, or start a new run.dir")
            if tag is None:  # a branch without a checkpoint of its own starts from its parent's (again)
                return self._branch_choice(branch_from, recorded) if branch_from or recorded else None
        else:
            problem = checkpoints.verify(Path(resume))
            if problem:
                raise UserError(f"--resume {resume}: {problem}")
            tag = Path(resume).name
        tag_dir = self.ckpt_root / tag
        saved, unsafe = self._check_checkpoint(tag_dir, "--resume", RESUMABLE)
        if unsafe and not allow_config_change:
            listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in unsafe)
            raise UserError(f"--resume: {tag} was trained with other settings: {listed}; set them back, or pass "
                            "--allow-config-change to apply them from here on")
        if any(key.startswith("model.") for key, _, _ in unsafe):
            self._check_weight_shapes(saved, tag)
        self.config_changes += unsafe
        return tag_dir

    def _check_checkpoint(self, tag_dir: Path, flag: str, allowed: tuple[str, ...]
                          ) -> tuple[checkpoints.TrainerState, list[tuple]]:
        """What every start from a checkpoint checks, before any rank's DeepSpeed loads a file: its
        pickle files and a universal form it would reuse, the global batch, the kind of data position,
        and this run's config against the checkpoint's (`self.config_changes`: the changes in
        `allowed`); returns its trainer state and the other changes."""
        saved = checkpoints.read_trainer_state(tag_dir)
        reused = ckpt.converted(tag_dir) if saved.world_size != self.world and saved.zero_stage > 0 else None
        unsafe = safe_load.checkpoint_problem(tag_dir, besides=checkpoints.DERIVED)
        if unsafe is None and reused is not None:
            unsafe = safe_load.checkpoint_problem(reused)
        if unsafe:
            raise UserError(unsafe)
        if saved.global_batch != self.global_batch:
            raise UserError(
                f"train: the checkpoint was trained with a global batch of {saved.global_batch}, this run has "
                f"{self.global_batch}; set train.global_batch={saved.global_batch} to keep the data order"
            )
        self._check_loader_kind(saved, tag_dir.name, flag)
        safe, unsafe = config_changes(saved.config, self.cfg, allowed)
        seq_then, seq_now = saved.data_seq_len, self.data_info and self.data_info.seq_len
        if seq_then and seq_now and seq_then != seq_now:
            unsafe.append(("data.train windows", seq_then, seq_now))
        self.config_changes = safe
        return saved, unsafe

    def _branch_choice(self, branch_from: str | None, recorded: branch.Origin | None) -> Path:
        """The parent's checkpoint a branch starts from (`self.origin`), checked: the one recorded when
        the branch first started, or the one --branch-from names. Its config may differ from this
        run's only in BRANCHABLE (schedule, length, checkpointing, eval, logging, run.*); the first
        other difference is refused."""
        if recorded is not None:
            tag_dir, source = branch.check_unchanged(recorded), recorded.source
        else:
            tag_dir, source = branch.resolve(branch_from, self._warn), branch_from
        flag = f"--branch-from {branch_from or source}"
        saved, unsafe = self._check_checkpoint(tag_dir, flag, BRANCHABLE)
        if unsafe:
            key, then, now = unsafe[0]
            raise UserError(f"{flag}: a branch may differ from its parent only in schedule, length, checkpoint, eval, "
                            f"logging and run settings; {key} is {then!r} in {tag_dir}, {now!r} here")
        if saved.world_size != self.world and saved.zero_stage > 0 and ckpt.converted(tag_dir) is None:
            raise UserError(f"{flag}: {tag_dir} was written by {saved.world_size} rank(s), this run has {self.world}, "
                            f"and a branch converts nothing in its parent: run `gpn-scale ckpt to-universal {tag_dir}` "
                            f"first, or branch on {saved.world_size} rank(s)")
        t = self.cfg.train
        if (t.stop_at_step or t.total_steps) <= saved.step:
            key = "stop_at_step" if t.stop_at_step else "total_steps"
            raise UserError(f"{flag}: {tag_dir} is at step {saved.step}; train.{key}={getattr(t, key)} leaves the "
                            "branch nothing to train")
        self.origin = branch.origin_of(source, tag_dir, saved.step)
        return tag_dir

    def _check_loader_kind(self, saved: checkpoints.TrainerState, tag: str, flag: str = "--resume") -> None:
        """A checkpoint's data position is a step of the prep's streams (with each slot's carried
        state beside it) or an epoch of shuffled windows; neither continues as the other, whatever
        --allow-config-change allows."""
        streams = saved.loader.get("kind") == "streams"
        if streams == bool(self.cfg.train.carry_state):
            return
        then = saved.config.get("data", {}).get("train") if isinstance(saved.config.get("data"), dict) else None
        if streams:
            raise UserError(f"{flag}: {tag} was trained with train.carry_state=true (its position is a step of the "
                            f"streams, each batch slot's state beside it); it resumes only as a carried-state run: set "
                            f"train.carry_state=true and data.train back to its streams ({then}), or start a new run.dir")
        raise UserError(f"{flag}: {tag} was trained on shuffled windows (train.carry_state=false, its position an "
                        f"epoch of {then}); it resumes only as such a run: set train.carry_state=false, or start "
                        "a new run.dir for carried-state training")

    def _check_weight_shapes(self, saved: checkpoints.TrainerState, tag: str) -> None:
        """--allow-config-change may change what the model computes, not the shapes of its weights,
        which DeepSpeed would find only half-way through loading them. Both models are built on
        the meta device: no memory, no initialisation."""
        from gpn_scale.config import model_config
        from gpn_scale.models import build_model

        with torch.device("meta"):
            then = build_model(model_config(saved.config["model"], where=f"{tag}/{checkpoints.TRAINER_STATE}: config.model"))
            now = build_model(self.cfg.model)
        shapes = [{k: tuple(v.shape) for k, v in m.state_dict().items()} for m in (then, now)]
        if shapes[0] != shapes[1]:
            name = next(k for k in sorted(shapes[0].keys() | shapes[1].keys()) if shapes[0].get(k) != shapes[1].get(k))
            held, wanted = (list(s[name]) if name in s else "absent" for s in shapes)
            raise UserError(f"--allow-config-change: {tag} holds weights of another shape ({name}: {held} in the "
                            f"checkpoint, {wanted} in this run's model); a model of another shape needs a new run.dir")

    def _build(self):
        import deepspeed

        from gpn_scale.models import MODEL_FAMILIES, build_model
        from gpn_scale.train.carry import CarriedStates, StreamBatches
        from gpn_scale.train.batches import ShuffledBatches

        cfg = self.cfg
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.model = build_model(cfg.model).to(self.device)
        spec = MODEL_FAMILIES[self.model.config.family]
        if getattr(self.model.config, "compile", False):  # the baselines' model.compile (docs/baselines.md)
            spec.compile_forward(self.model)

        saved = checkpoints.read_trainer_state(self.resume_dir) if self.resume_dir else None
        universal = saved is not None and saved.world_size != self.world and saved.zero_stage > 0

        optimizer, scheduler = optim.build(spec.param_groups(self.model), cfg.train)
        t = cfg.train
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=self.model, optimizer=optimizer, lr_scheduler=scheduler,
            config=deepspeed_config(cfg, self.grad_accum, universal),
        )
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        if type(self.engine.checkpoint_engine) is TorchCheckpointEngine:  # DeepSpeed's default; others write their own way
            self.engine.checkpoint_engine = ckpt.HashingSaves(self.engine.checkpoint_engine)
        if cfg.zero.stage == 3:
            from deepspeed.runtime.zero.partition_parameters import register_external_parameter

            for p in spec.zero3_external_params(self.model):
                register_external_parameter(self.model, p)
        if t.carry_state:
            self.data = StreamBatches(cfg.data.train, t.micro_batch, self.grad_accum, self.world, self.rank)
            self.carried = CarriedStates(self.data)
        else:
            self.data = ShuffledBatches(
                cfg.data.train, cfg.data.cache, t.micro_batch, self.world, shuffle=cfg.data.shuffle,
                seed=cfg.seed, num_canonical_nodes=cfg.data.num_canonical_nodes,
            )
        self.step, self.tokens = 0, 0
        if saved is not None:
            self._load(saved, universal)

    def _load(self, saved: checkpoints.TrainerState, universal: bool) -> None:
        tag_dir = self.resume_dir
        if universal:
            if self.is_main and self.origin is None:  # a branch reuses its parent's conversion (_branch_choice)
                self._say(f"world size {saved.world_size} -> {self.world}: converting {tag_dir} to universal form")
                ckpt.to_universal(tag_dir)
            torch.distributed.barrier()
            load_dir, tag = tag_dir, ckpt.UNIVERSAL
        else:
            load_dir, tag = tag_dir.parent, tag_dir.name
        # Rank 0 checked every file of this checkpoint in _resume_choice; DeepSpeed's loads run
        # under torch's restricted unpickler (safe_load.restricted, in load_engine).
        try:
            if ckpt.load_engine(self.engine, load_dir, tag, self.cfg.train) is None:
                raise UserError(f"{tag_dir}: DeepSpeed could not load this checkpoint")
            self.step, self.tokens = saved.step, saved.tokens
            self.data.load_state_dict(saved.loader)
            if not ckpt.load_rng(tag_dir, self.rank):
                torch.manual_seed(self.cfg.seed + self.rank + 1000 * self.step)  # a new rank: fresh, reproducible
            if self.carried is not None:
                self.carried.load(tag_dir, self.device)
        except FileNotFoundError as e:
            if self.origin is None:
                raise
            raise UserError(f"--branch-from: {e.filename or tag_dir} went while it was read (the parent's rotation, "
                            "train.keep_last, removed the checkpoint: branch from one of its train.keep_steps)") from None
        verb = "resumed" if self.origin is None else "branched"
        self._say(f"{verb} from {tag_dir} at step {self.step} ({self.tokens:,} tokens)")

    # ---- the loop ------------------------------------------------------------------------------

    def _autocast(self):
        if self.cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        if norm is None:  # ZeRO stage 0 does not record it
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else None
        return None if norm is None else float(norm)

    def _train_step(self) -> StepMetrics:
        """One optimiser step: `grad_accum` micro-batches per rank, then DeepSpeed's clipped AdamW
        update. Records this rank's sample ids for samples.jsonl."""
        began = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]  # what this step's update uses; the scheduler moves after it
        losses, self.step_samples = [], []
        grad_norm = None
        waited = 0.0  # for the loader's batches
        for micro in range(self.grad_accum):
            asked = time.perf_counter()
            with profiling.section("data_wait"):
                batch = next(self.data)
            waited += time.perf_counter() - asked
            tokens = batch["tokens"].to(self.device, non_blocking=True)
            resets = self._resets(tokens)
            with self._autocast(), profiling.section("forward"):
                if self.carried is None:
                    loss = self.engine(tokens, **resets).loss
                else:  # this micro-batch's slots go on from the state their last window ended with
                    # (a stream's first window: from the empty state, the last stream having ended mid-document)
                    state = None if batch["stream_start"] else self.carried.get(batch["micro"])
                    out = self.engine(tokens, state=state, **resets)
                    loss = out.loss
                    self.carried.put(batch["micro"], out.state)
            with profiling.section("backward"):
                self.engine.backward(loss)
            if micro == self.grad_accum - 1 and self.cfg.zero.stage == 0:
                grad_norm = self._grad_norm()  # before step() clears the gradients
            with profiling.section("optimizer_step"):  # DeepSpeed's: the update at the last micro-batch
                self.engine.step()
            losses.append(loss.item())
            self.step_samples += batch["sample_id"].tolist()
        if self.cfg.zero.stage > 0:
            grad_norm = self._grad_norm()
        loss = dist_utils.all_mean(sum(losses) / len(losses))
        peak_mem = dist_utils.all_max(peak_memory_bytes(self.device))
        wait = torch.tensor([waited], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(wait, op=torch.distributed.ReduceOp.MAX)  # the slowest rank's holds all up
        mix = None
        if self.carried is None and self.data.source_names:  # a mixture: which source each sample came from
            counts = torch.tensor(self.data.count_sources(self.step_samples), dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(counts)
            mix = self.data.record_mix(counts.tolist())
        step_tokens = self.global_batch * tokens.shape[1]
        self.step += 1
        self.tokens += step_tokens
        step_time = time.perf_counter() - began
        tokens_per_s = step_tokens / step_time
        mfu = (tokens_per_s * flops_per_token(self.model, tokens.shape[1]) / (self.peak_flops * self.world)
               if self.peak_flops else None)
        return StepMetrics(step=self.step, loss=loss, lr=lr, grad_norm=grad_norm, tokens=self.tokens,
                           tokens_per_s=tokens_per_s, step_time_s=step_time, peak_mem_bytes=peak_mem,
                           elapsed_s=self.clock.elapsed(), eta_s=self.clock.eta(self.step), mfu=mfu,
                           data_wait_s=wait.item(), mix=mix)

    def _resets(self, tokens: torch.Tensor) -> dict:
        """The forward's `resets` keyword: the state after each EOS is the empty one (models/resets.py)."""
        return {"resets": tokens == self.data_info.eos_id} if self.cfg.train.reset_on_eos else {}

    @torch.no_grad()
    def evaluate(self) -> dict:
        if not self.cfg.data.val:
            return {}
        self.model.eval()
        windows = self._val_windows()
        totals = torch.zeros(len(windows), 2, dtype=torch.float64, device=self.device)  # (loss sum, tokens) per source
        for i, source in enumerate(windows.values()):
            for tokens, rows in source.batches():  # this rank's block of the same windows at any world size
                tokens = tokens.to(self.device)
                with self._autocast():  # read as the run trains: the state reset at EOS with train.reset_on_eos
                    out = self.engine(tokens, **self._resets(tokens))
                totals[i] += torch.tensor([out.token_losses[:rows].double().sum().item(),
                                           out.token_losses[:rows].numel()], dtype=torch.float64, device=self.device)
        self.model.train()
        torch.distributed.all_reduce(totals)

        def mean(loss_sum, tokens) -> float:
            return (loss_sum / tokens).item() if tokens > 0 else float("nan")

        total = totals.sum(0)
        loss = mean(*total)
        result = {"val_loss": loss, "val_ppl": math.exp(loss) if loss < 50 else float("inf"), "val_tokens": int(total[1])}
        if isinstance(self.cfg.data.val, list):  # a mixture's sources, each on its own too
            result.update({f"val_loss/{name}": mean(*totals[i]) for i, name in enumerate(windows)})
        return result

    def _val_windows(self) -> dict:
        """For each source of data.val (one for a directory or URL), by name: its first eval.batches x
        train.micro_batch windows, split across the ranks."""
        if self._val is None:
            from gpn_scale.train.validation import ValWindows

            mb = self.cfg.train.micro_batch
            self._val = {source.name: ValWindows(source.path, self.cfg.data.cache, self.cfg.eval.batches * mb, mb,
                                                 self.rank, self.world) for source in sources(self.cfg.data.val)}
        return self._val

    def save(self) -> Path:
        tag = checkpoints.tag_for(self.step)
        tag_dir = self.ckpt_root / tag
        if self.is_main and tag_dir.exists():  # a leftover of a crashed save of the same step, or one this run replaces
            shutil.rmtree(tag_dir)
        torch.distributed.barrier()
        try:
            self.engine.save_checkpoint(str(self.ckpt_root), tag=tag, save_latest=False)
            written = ckpt.save_rng(tag_dir, self.rank)
            if self.carried is not None:
                written |= self.carried.save(tag_dir)
            if self.is_main:
                ckpt.write_trainer_state(tag_dir, {
                    "step": self.step, "tokens": self.tokens, "loader": self.data.state_dict(),
                    "world_size": self.world, "zero_stage": self.cfg.zero.stage, "global_batch": self.global_batch,
                    "data_seq_len": self.data_info and self.data_info.seq_len, "config": self.cfg.to_dict(),
                })
        except (OSError, RuntimeError) as e:
            if not _disk_full(e, self.ckpt_root):
                raise
            # Without its manifest the partial save is ignored by --resume auto; removing it gives
            # the space back (nothing of it is usable).
            shutil.rmtree(tag_dir, ignore_errors=True)
            previous = checkpoints.committed(self.ckpt_root)
            raise UserError(f"checkpoint {tag_dir}: no space left on device ({shutil.disk_usage(self.ckpt_root).free:,} "
                            f"bytes free); the partial save was removed; free space and resume with --resume auto"
                            + (f" (from {previous[0]})" if previous else "")) from None
        torch.distributed.barrier()  # every rank's files are on disk before any is hashed
        if isinstance(self.engine.checkpoint_engine, ckpt.HashingSaves):
            written |= self.engine.checkpoint_engine.take(tag_dir)
        reports = dist_utils.gather_objects(ckpt.hash_own_files(tag_dir, self.rank, self.world, written))
        if self.is_main:
            ckpt.commit(self.ckpt_root, tag, self.cfg.train.keep_last, self.verified, reports,
                        keep_steps=frozenset(self.cfg.train.keep_steps))
        torch.distributed.barrier()
        return tag_dir

    def _write_status(self, outcome: str) -> None:
        if self.is_main:
            write_status(self.run_dir, outcome, self.step, self.world)

    def run(self) -> int:
        """Train to `stop_at`; after each step log, audit, evaluate, check for preemption, save."""
        self._start()
        outcome = Outcome.FINISHED
        if self.stop_flag.agreed():  # a stop signal while the run was starting up: no step is begun
            outcome = Outcome.INTERRUPTED if self.stop_flag.signal_name == "SIGINT" else Outcome.PREEMPTED
        with GarbageCollection() as collector:
            while self.step < self.stop_at and outcome is Outcome.FINISHED:
                self.profiler.begin(self.step + 1)
                try:
                    metrics = self._train_step()
                except torch.cuda.OutOfMemoryError:
                    self.snapshots.oom(self.step + 1)
                    raise
                self.profiler.end(self.step)
                self.snapshots.after_step(self.step)
                collector.step(self.step)
                self._log(metrics)
                if self.audit.observe(metrics.loss, metrics.grad_norm):
                    outcome = Outcome.DIVERGED
                    break
                self._eval_if_due()
                if self.stop_flag.agreed():
                    outcome = Outcome.INTERRUPTED if self.stop_flag.signal_name == "SIGINT" else Outcome.PREEMPTED
                    break
                self._save_if_due()
        return self._finish(outcome)

    # ---- the loop's steps ----------------------------------------------------------------------

    def _start(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        self._build()  # and load the checkpoint resumed from: nothing is written before that succeeded
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            if self.origin is not None:  # a branch starts: where from, and no records of an earlier start
                branch.write_origin(self.run_dir, self.origin)
                for name in ("metrics.jsonl", "samples.jsonl"):  # as a fresh start's: from step 0
                    kept = truncate_jsonl(self.run_dir / name, 0)
                    if kept is not None:
                        self._warn(f"{self.run_dir / name}: an earlier start's records dropped; the previous file is "
                                   f"kept as {kept}")
            elif self.resume_dir is None:  # a fresh start: no longer the branch an earlier start may have begun
                (self.run_dir / branch.BRANCH_FILE).unlink(missing_ok=True)
        self._write_status("running")
        self.stop_at = t.stop_at_step or t.total_steps
        self.start_step, self.start_tokens = self.step, self.tokens
        self.audit = Audit(t.nonfinite_patience)
        self.clock = RunClock(self.stop_at)
        self.peak_flops = peak_flops(cfg.logging.peak_tflops)
        cuda = self.device.type == "cuda"
        self.profiler = profiling.StepProfiler(cfg.profile.steps, self.run_dir, self.rank, cuda)
        self.snapshots = profiling.MemorySnapshots(cfg.profile.memory_snapshot_step, self.run_dir, self.rank)
        self.snapshots.start()
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters())
        self._say(
            f"training {cfg.model.family} ({n_params:,} parameters) on {self.world} rank(s), ZeRO-{cfg.zero.stage}, "
            f"{cfg.precision}; global batch {self.global_batch} = {t.micro_batch} x {self.grad_accum} x {self.world}; "
            f"steps {self.step} -> {self.stop_at} of {t.total_steps}"
        )
        if self.carried is None and self.data.source_names:
            plan = ", ".join(f"{name} {drawn:,} of its {held:,} ({source.weight()})" for (name, held, drawn), source
                             in zip(self.data.epoch_plan(), cfg.data.train))
            self._say(f"data: a mixture of {len(cfg.data.train)} sources; samples per epoch: {plan}")
        lg = cfg.logging
        self.log = MetricsLog(self.run_dir, cfg.to_dict(), lg.wandb, lg.project, cfg.run.name or self.run_dir.name,
                              self.step, t.total_steps, self.is_main, wandb_entity=lg.wandb_entity,
                              wandb_group=lg.wandb_group, wandb_tags=lg.wandb_tags, tensorboard=lg.tensorboard)
        changes = {k: {"checkpoint": a, "now": b} for k, a, b in self.config_changes}
        if self.origin is not None:
            listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in self.config_changes) or "none"
            self._say(f"branch of {self.origin.checkpoint} (step {self.origin.step}); settings changed: {listed}")
            self.log.log({"step": self.step, "event": "branch", "branch": dataclasses.asdict(self.origin),
                          "changes": changes})
        elif self.config_changes:
            listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in self.config_changes)
            self._say(f"resuming with changed settings: {listed}")
            self.log.log({"step": self.step, "event": "config_change", "changes": changes})
        if cfg.data.log_sample_ids and self.is_main:
            truncate_jsonl(self.run_dir / "samples.jsonl", self.step)
            self.samples_file = JsonLines(self.run_dir / "samples.jsonl")

    def _log(self, metrics: StepMetrics) -> None:
        self.last_loss = metrics.loss
        self.step_seconds += metrics.step_time_s
        if self.cfg.data.log_sample_ids:
            every_rank = dist_utils.gather_objects(self.step_samples)
            if self.samples_file:
                self.samples_file.write({"step": metrics.step, "samples": sorted(sum(every_rank, []))})
        self.log.log(metrics.as_dict())
        self.log.progress(metrics)

    def _eval_if_due(self) -> None:
        if loop.due(self.step, self.cfg.eval.every, self.cfg.train.total_steps):
            self._record_eval()

    def _record_eval(self) -> None:
        result = self.evaluate()
        self.log.log({"step": self.step, **result})
        if result:
            self.last_eval = {"step": self.step, **result}

    def _save_if_due(self) -> None:
        t = self.cfg.train
        kept = self.step in t.keep_steps and self.step < self.stop_at  # at stop_at: the end saves it
        if (loop.due(self.step, t.save_every, self.stop_at) or kept) and self.audit.clean:
            self.save()

    def _finish(self, outcome: Outcome) -> int:
        """The end of the run: a final evaluation and checkpoint (not of a diverged state), status.json,
        and the exit status."""
        t = self.cfg.train
        if outcome is not Outcome.DIVERGED and self.audit.at_end():
            outcome = Outcome.DIVERGED
        if outcome is Outcome.DIVERGED:
            tag_dir = None  # the non-finite state is not saved
        elif self.step == self.start_step:  # resumed at its last step: nothing new to evaluate or save
            tag_dir = self.ckpt_root / checkpoints.tag_for(self.step)
        else:
            if self.step >= t.total_steps:
                self._record_eval()
            tag_dir = self.save()
        self.profiler.close()  # a run that stopped inside profile.steps: the trace of the steps it ran
        self.snapshots.close()
        if self.samples_file:
            self.samples_file.close()
        self.log.close()
        self.stop_flag.close()
        self._write_status(outcome.value)
        if outcome is Outcome.DIVERGED:
            good = checkpoints.committed(self.ckpt_root)
            self._warn(f"error: step {self.step}: {self.audit.reason}: the run diverged; nothing saved after it"
                       + (f", the newest checkpoint is {self.ckpt_root / good[0]}" if good else "")
                       + f" (lower train.lr or raise train.warmup_steps; train.nonfinite_patience={t.nonfinite_patience})")
            self._say(self._summary())
            return EXIT_DIVERGED
        if outcome is not Outcome.FINISHED:
            code = EXIT_INTERRUPTED if outcome is Outcome.INTERRUPTED else EXIT_PREEMPTED
            if self.step == self.start_step:
                where = (f"stopped before step {self.step + 1}, nothing new to checkpoint"
                         + (f" (the newest checkpoint is {tag_dir})" if tag_dir.is_dir() else ""))
            else:
                where = f"checkpointed at step {self.step} in {tag_dir}"
            self._say(f"{self.stop_flag.signal_name} received: {where}; exiting with {code} "
                      "(resume with --resume auto)")
            self._say(self._summary())
            return code
        graphs = graphs_of(self.model)
        if graphs is not None:
            self._say(f"fused core graphs: {graphs.summary()}")
        self._say(f"done at step {self.step}: checkpoint {tag_dir}, metrics {self.run_dir / 'metrics.jsonl'}")
        self._say(self._summary())
        return 0

    def _summary(self) -> str:
        e = self.last_eval or {}
        return summary_line(RunSummary(
            step=self.step, train_loss=self.last_loss, val_loss=e.get("val_loss"), val_ppl=e.get("val_ppl"),
            val_step=e.get("step"), tokens=self.tokens - self.start_tokens, step_seconds=self.step_seconds,
            wall_seconds=time.monotonic() - self.launched))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="gpn-scale train", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="training YAML (or a name in configs/train/)")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.total_steps=100 zero.stage=3 (every key, "
                                                 "its type, default and meaning: gpn-scale config keys)")
    ap.add_argument("--resume", default=None,
                    help="auto: the newest complete checkpoint of run.dir; none (default): start fresh; or a "
                         "checkpoint dir of run.dir")
    ap.add_argument("--branch-from", metavar="CKPT",
                    help="a decay branch: start from another run's checkpoint (RUN/checkpoints/step_N, or RUN for "
                         "its newest) with its weights, optimiser, step and data position, into this run.dir, writing "
                         "nothing into RUN. The config may differ from the checkpoint's only in schedule and length "
                         "(total_steps, schedule, decay_steps, decay_fraction, decay_shape, min_lr_ratio, "
                         "stop_at_step, save_every, keep_steps, keep_last), eval.*, logging.*, profile.* and run.*. "
                         "Run again, it resumes the branch's own newest checkpoint (docs/train.md, 'Schedules and "
                         "decay branches')")
    ap.add_argument("--allow-config-change", action="store_true",
                    help="on resume, apply settings that differ from the checkpoint's even where they change what "
                         "the run computes (lr, model, data, ...); the change is recorded in metrics.jsonl")
    look = ap.add_mutually_exclusive_group()
    look.add_argument("--check", action="store_true",
                      help="check the config, the data and run.dir as each rank does before it starts, then exit (0, "
                           "or 2 with the one line): what the launchers run before torchrun starts the ranks")
    look.add_argument("--print-config", action="store_true",
                      help="print the resolved config as YAML, each value with its origin (default, the YAML file, "
                           "or override), then exit; the config is validated as for a run, the data and run.dir are "
                           "not looked at (--check does that) and nothing is written")
    ap.add_argument("--json", action="store_true",
                    help="with --print-config: one JSON object {config, origins, model_chosen_in}, alone on stdout")
    args = ap.parse_intermixed_args(argv)  # key=value overrides may come after flags
    if args.json and not args.print_config:
        raise UserError("--json: prints the config of --print-config; pass --print-config too")
    if args.print_config:
        from gpn_scale.train.config_view import print_config

        _resume_mode(args)  # refuses flags that cannot go together, as a run would
        print_config(resolve_train_config(args.config, args.overrides), args.json)
        return 0
    try:  # the same files and settings on every rank: the same error everywhere
        resume = _resume_mode(args)
        cfg = load_train_config(args.config, args.overrides)
        # warnings once, by the rank that will train (a launcher's --check beforehand leaves them to it)
        warn = None if args.check or os.environ.get("RANK", "0") != "0" else lambda line: print(line, file=sys.stderr)
        data = preflight.check(cfg, resume, resolve_config_path(args.config, "train"), branch_from=args.branch_from,
                               warn=warn)
        refusal = profiling.memory_snapshot_refusal(cfg.profile.memory_snapshot_step, torch.cuda.is_available())
        if refusal:
            raise UserError(refusal)
    except UserError as e:
        e.every_rank = True
        raise
    if args.check:
        return 0
    os.environ.setdefault("WANDB_SILENT", "true")
    lock = RunLock(Path(cfg.run.dir)) if os.environ.get("RANK", "0") == "0" else None
    trainer = None
    try:
        trainer = Trainer(cfg, resume, data, args.allow_config_change, args.branch_from)
        return trainer.run()
    except BaseException as e:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            e = UserError(f"{e.filename or cfg.run.dir}: no space left on device")
        # A second Ctrl-C inside a library (torch.save's zip writer) may come back as the error the
        # library raised over it while cleaning up: still an interruption, not a crash.
        e = _interruption_under(e) or e
        if lock is not None:  # every way out of a run leaves its status: never "running" after it ended
            _record_failure(Path(cfg.run.dir), trainer, e)
        if isinstance(e, (UserError, KeyboardInterrupt)):
            raise e from None
        raise
    finally:
        if lock is not None:
            lock.release()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _resume_mode(args: argparse.Namespace) -> str:
    """--resume's value; a branch resumes by itself (its own newest checkpoint, else its parent's)."""
    if args.branch_from is None:
        return args.resume or "none"
    if args.resume not in (None, "auto"):
        raise UserError(f"--branch-from with --resume {args.resume}: a branch resumes its own newest checkpoint by "
                        "itself (give --resume auto or nothing)")
    if args.allow_config_change:
        raise UserError("--branch-from with --allow-config-change: a branch differs from its parent only in schedule, "
                        "length, checkpoint, eval, logging and run settings; other changes need a new run")
    return "auto"


def _interruption_under(error: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt an exception was raised while handling, if any."""
    seen = error
    while seen is not None and not isinstance(seen, KeyboardInterrupt):
        seen = seen.__context__
    return seen if seen is not error else None


def write_status(run_dir: Path, status: str, step: int | None, world: int | None, reason: str | None = None) -> None:
    """run.dir/status.json, replaced atomically. On a full disk, where the replacement has no room,
    the file (one small block) is rewritten in place: a launcher must not read "running" after the
    run ended."""
    record = {"status": status, "step": step, "world_size": world} | ({"reason": reason} if reason else {})
    text = json.dumps(record) + "\n"
    path = run_dir / "status.json"
    try:
        atomic.write_text(path, text)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not path.is_file():
            raise
        with open(path, "r+") as f:
            f.truncate(0)
            f.write(text)


def _record_failure(run_dir: Path, trainer: Trainer | None, error: BaseException) -> None:
    """status.json of a run that ended by an exception: "interrupted" for a second Ctrl-C (no
    checkpoint), "failed" with the error's first line otherwise. A process refused before it began
    (its resume, config or data refused) leaves the final status of the run's last process as it is:
    only a run this process marked "running", or a directory without a status, gets one."""
    try:
        previous = json.loads((run_dir / "status.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        previous = None
    if previous not in (None, "running"):
        return
    first_line = (str(error).splitlines() or [""])[0]
    if isinstance(error, KeyboardInterrupt):
        status, reason = Outcome.INTERRUPTED.value, "a second SIGINT stopped it at once, without a checkpoint"
    elif isinstance(error, UserError):
        status, reason = Outcome.FAILED.value, first_line
    else:  # a crash: its traceback follows on stderr
        status, reason = Outcome.FAILED.value, f"{type(error).__name__}: {first_line}"
    step = trainer.step if trainer is not None else None
    world = trainer.world if trainer is not None else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        write_status(run_dir, status, step, world, reason)
    except OSError:  # the disk is gone or full beyond repair: the error line still reaches the user
        pass


def _disk_full(error: Exception, path: Path) -> bool:
    """Whether a failed write was the disk filling up: torch.save reports it only as a failed
    write ("unexpected pos ..."), so a nearly full filesystem is taken as the cause."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    usage = shutil.disk_usage(path)
    return usage.free < min(64 << 20, usage.total // 100)
