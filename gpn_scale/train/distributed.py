"""Process-group setup and the collectively agreed stop flag.

Works as one plain process (no launcher), under torchrun / srun / deepspeed's launcher (they set
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), on GPUs with NCCL and on CPUs with gloo.
"""

from __future__ import annotations

import os
import signal
import socket

import torch
import torch.distributed as dist

from data_prep.errors import UserError
from gpn_scale.train import stop

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init() -> tuple[int, int, int]:
    """(rank, world_size, local_rank); initialises the default process group through DeepSpeed."""
    import deepspeed

    env = os.environ
    if "RANK" not in env:  # a plain single process
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    env["LOCAL_WORLD_SIZE"] = str(_ranks_per_host())
    local_rank = int(env.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


def _ranks_per_host() -> int:
    """The ranks sharing this machine, for streaming, whose shared memory is per machine.

    A launcher's LOCAL_WORLD_SIZE counts the ranks of one agent; several agents may share a host
    (elastic runs, tests of multi-node setups), and streaming must then see them as one node.
    """
    host = socket.gethostname()
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host)
    per_host = hosts.count(host)
    regular = all(hosts[i] == hosts[i - i % per_host] for i in range(len(hosts))) and len(hosts) % per_host == 0
    if not regular or any(hosts.count(h) != per_host for h in hosts):
        raise UserError(f"ranks are spread unevenly over hosts ({hosts}): the data loader needs the same "
                           "number of consecutive ranks on every host")
    return per_host


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class StopFlag:
    """Set by SIGTERM / SIGUSR1 / SIGINT on any rank (recorded by `gpn_scale.train.stop` from the
    command's start); every rank learns of it at the same step boundary. After a first SIGINT, a
    second one interrupts at once (Ctrl-C twice: no checkpoint)."""

    def __init__(self):
        stop.record()  # already recording when started from the CLI
        self.signal_name = None  # of the signal agreed on, on every rank

    def close(self) -> None:
        stop.ignore()

    def agreed(self) -> bool:
        flag = torch.tensor([stop.received()], dtype=torch.int64, device=device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self.signal_name = signal.Signals(flag.item()).name
        return bool(flag.item())


def all_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def broadcast_object(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_max(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
