"""What a run measures at each step, and where it goes: `metrics.jsonl`, wandb, TensorBoard event
files (`logging.tensorboard`), and a progress bar or progress lines, then a closing summary (all on
rank 0).

Progress goes to stdout, where DeepSpeed's log goes too, so `gpn-scale train ... | tee train.log`
and a SLURM output file keep it: on a terminal a redrawn bar, elsewhere (a pipe, a file) a plain
line every `LINE_EVERY_S` and at the last step. Only stdout decides: under `| tee` the terminal
shows the lines tee copies, and no bar on stderr beside them."""

from __future__ import annotations

import dataclasses
import resource
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpn_scale.storage.jsonl import JsonLines, truncate_jsonl
from data_prep.errors import read_text

# Off a terminal (a SLURM log, nohup) a redrawn bar is unreadable: a plain line this often instead.
LINE_EVERY_S = 30.0
# A plain progress line is followed by a data-wait line when the steps since the previous line spent
# at least this share of their time waiting for the loader.
DATA_WAIT_SHARE = 0.1
TENSORBOARD_DIR = "tensorboard"

# Dense bf16 peak per device, for MFU when `logging.peak_tflops` is not set.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def peak_flops(configured_tflops: float | None) -> float | None:
    if configured_tflops:
        return configured_tflops * 1e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, tflops in _PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None  # unknown (e.g. CPU): MFU is not reported


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of windows of `seq_len` (docs/train.md, 'MFU'): 6 per parameter
    (2 forward, 4 backward: the recurrent core applies each loop weight once per token and layer,
    like a layered model; the tied embedding counts once, as the decoder's matmul), plus 3x the
    forward FLOPs no parameter accounts for: GPN+M's matrix memory (per token a write, M^T k and
    the decayed rank-1 update, 4 FLOPs per cell, and a read per layer, 2 per cell), GDN's
    per-layer delta rule on S (the same write and one read), and the Transformer's attention
    (q.k and the weighted sum of v, 2 FLOPs each per key, over (seq_len + 1) / 2 keys on average)."""
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 keeps only a shard
    cfg = model.config
    if cfg.family == "gpn_m":
        extra = (4 + 2 * cfg.n_layers) * cfg.n_heads * cfg.d_key * cfg.d_val
    elif cfg.family == "gdn":
        extra = cfg.n_layers * (4 + 2) * cfg.n_heads * cfg.d_key * cfg.d_val
    elif cfg.family == "transformer":
        extra = cfg.n_layers * 4 * cfg.d_model * (seq_len + 1) / 2
    else:
        extra = 0
    return 6.0 * n + 3 * extra


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak so far: CUDA's max allocated on a GPU, the resident set (RSS) on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def duration(seconds: float) -> str:
    """12s, 12m, 3h05m: coarse enough to read at a glance in a log."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


class RunClock:
    """Elapsed time of this launch's training loop, and the ETA to `stop_at` from the mean step
    time since the launch's first step (which builds kernels and warms caches, so it predicts
    nothing; checkpoint saves and evaluations after it count, as a user waits for them too)."""

    def __init__(self, stop_at: int, now=time.monotonic):
        self.now = now
        self.stop_at = stop_at
        self.started = now()
        self.first: tuple[int, float] | None = None  # (step, time) at the end of the first step

    def elapsed(self) -> float:
        return self.now() - self.started

    def eta(self, step: int) -> float | None:
        """Seconds left after `step`; call it at the end of every step (the first one has no rate yet)."""
        if self.first is None:
            self.first = (step, self.now())
            return None
        done = step - self.first[0]
        return (self.now() - self.first[1]) / done * (self.stop_at - step) if done > 0 else None


@dataclass
class StepMetrics:
    """One optimiser step's line of metrics.jsonl (and wandb's step)."""

    step: int
    loss: float
    lr: float  # the learning rate this step's update used
    grad_norm: float | None  # before clipping
    tokens: int  # trained on so far, over all ranks
    tokens_per_s: float
    step_time_s: float
    peak_mem_bytes: int  # the largest over ranks
    elapsed_s: float
    eta_s: float | None
    mfu: float | None  # model FLOPs utilisation, where a peak is known or configured
    # seconds the step waited for its batches from the loader (part of step_time_s), the largest over ranks
    data_wait_s: float | None = None
    # a mixture (data.train a list of sources): each source's share of the samples read so far, by name
    mix: dict[str, float] | None = None

    def as_dict(self) -> dict:
        """The record, a mixture's shares as flat `mix/NAME` scalars (as wandb and TensorBoard take them)."""
        record = dataclasses.asdict(self)
        mix = record.pop("mix")
        record.update({f"mix/{name}": share for name, share in (mix or {}).items()})
        return record


def clock_time(seconds: float) -> str:
    """45s, 24m13s, 3h05m12s: a wall time to the second."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


@dataclass
class RunSummary:
    """What a launch of the training loop did, for its closing line."""

    step: int  # where it stopped
    train_loss: float | None  # the last step's (None: no step ran in this launch)
    val_loss: float | None  # the newest evaluation's in this launch (None: none ran)
    val_ppl: float | None
    val_step: int | None
    tokens: int  # trained in this launch, over all ranks
    step_seconds: float  # the sum of this launch's step times
    wall_seconds: float  # this launch, from the trainer's start to its end


def summary_line(s: RunSummary) -> str:
    """`train loss 3.2100 (step 300) | val loss 3.3000, PPL 27.11 (step 300) | 12,346 tok/s | wall time 24m13s`;
    tok/s is the mean over this launch's steps."""
    train = "train loss -" if s.train_loss is None else f"train loss {s.train_loss:.4f} (step {s.step})"
    val = ("val loss - (not evaluated in this run)" if s.val_loss is None
           else f"val loss {s.val_loss:.4f}, PPL {s.val_ppl:.2f} (step {s.val_step})")
    rate = f"{s.tokens / s.step_seconds:,.0f} tok/s" if s.step_seconds > 0 else "- tok/s"
    return f"{train} | {val} | {rate} | wall time {clock_time(s.wall_seconds)}"


def progress_line(m: StepMetrics, total_steps: int) -> str:
    eta = "" if m.eta_s is None else f", ETA {duration(m.eta_s)}"
    return (f"step {m.step}/{total_steps} | loss {m.loss:.4f} | {m.tokens_per_s:,.0f} tok/s | "
            f"{m.peak_mem_bytes / 2**30:.1f} GiB | {duration(m.elapsed_s)} elapsed{eta}")


def data_wait_line(waited: float, stepped: float, first: int, last: int) -> str | None:
    """The line that follows a plain progress line when the loader held the steps `first`..`last`
    up for DATA_WAIT_SHARE of their time or more; None otherwise."""
    if stepped <= 0 or waited < DATA_WAIT_SHARE * stepped:
        return None
    steps = f"step {last}" if first == last else f"steps {first}-{last}"
    return (f"data wait {waited / stepped:.0%} of the step time over {steps} ({waited:.1f}s of {stepped:.1f}s): "
            "the loader is behind the model")


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a metrics.jsonl record, as TensorBoard scalars (not its step, events or nulls)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricsLog:
    def __init__(self, run_dir: Path, config: dict, wandb_mode: str, project: str, name: str,
                 start_step: int, total_steps: int, enabled: bool, out=None, *, wandb_entity: str | None = None,
                 wandb_group: str | None = None, wandb_tags: list[str] | tuple = (), tensorboard: bool = False):
        """`out`: where progress and messages go (default: stdout). `tensorboard`: the records' scalars
        also go to TensorBoard event files in run_dir/tensorboard (a resumed run's steps after
        `start_step` that an earlier launch wrote there are purged, as metrics.jsonl's are)."""
        self.enabled = enabled
        self.out = sys.stdout if out is None else out
        self.path = run_dir / "metrics.jsonl"
        self.wandb = None
        self.tensorboard = None
        self.bar = None
        self.total_steps = total_steps
        self.last_line = time.monotonic()
        self.waited, self.stepped, self.line_from = 0.0, 0.0, start_step + 1  # since the last plain line
        if not enabled:
            return
        kept = truncate_jsonl(self.path, start_step)
        if kept is not None:
            print(f"{self.path}: records after step {start_step} (or torn) dropped; the previous file is kept as {kept}",
                  file=sys.stderr, flush=True)
        self.file = JsonLines(self.path)
        if wandb_mode != "disabled":
            import wandb

            id_file = run_dir / "wandb_id"
            run_id = read_text(id_file).strip() if id_file.is_file() else secrets.token_hex(6)
            id_file.write_text(run_id)
            self.wandb = wandb.init(project=project, entity=wandb_entity, group=wandb_group,
                                    tags=list(wandb_tags) or None, name=name, id=run_id, resume="allow",
                                    dir=str(run_dir), mode=wandb_mode, config=config)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR),
                                             purge_step=start_step + 1 if start_step else None)
        if not self.out.isatty():
            return
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, mininterval=1.0,
                        file=self.out)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(record)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])
        if self.tensorboard is not None:
            for tag, value in scalars(record).items():
                self.tensorboard.add_scalar(tag, value, global_step=record["step"])

    def progress(self, m: StepMetrics) -> None:
        if self.bar is not None:  # tqdm shows the elapsed time and the ETA itself
            self.bar.n = m.step
            wait = {} if m.data_wait_s is None else {"data_wait": f"{m.data_wait_s:.2f}s"}
            self.bar.set_postfix(loss=f"{m.loss:.4f}", tok_s=f"{m.tokens_per_s:,.0f}",
                                 mem=f"{m.peak_mem_bytes / 2**30:.1f}G", **wait, refresh=False)
            self.bar.refresh()
            return
        self.waited += m.data_wait_s or 0.0
        self.stepped += m.step_time_s
        if self.enabled and (time.monotonic() - self.last_line >= LINE_EVERY_S or m.step == self.total_steps):
            self.last_line = time.monotonic()
            print(progress_line(m, self.total_steps), file=self.out, flush=True)
            wait = data_wait_line(self.waited, self.stepped, self.line_from, m.step)
            if wait is not None:
                print(wait, file=self.out, flush=True)
            self.waited, self.stepped, self.line_from = 0.0, 0.0, m.step + 1

    def write(self, message: str) -> None:
        """A line of the run's report, beside the progress (above a bar, which is redrawn under it)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=self.out)
        else:
            print(message, file=self.out, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
