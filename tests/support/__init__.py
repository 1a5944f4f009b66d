"""What the suite's test modules share (tests/conftest.py puts tests/ on sys.path, so `support.X`
imports from any folder): the repository's root, free ports, and how a test starts gpn-scale in a
process of its own. The modules beside this one hold the fixtures and references of one topic each."""

import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port nothing on this host listens on right now (for a rendezvous, a store, slurmctld)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return True
    except OSError:
        return False


def gpn_scale_command(nproc: int = 1) -> list[str]:
    """`python -m gpn_scale`, under torch.distributed.run with nproc ranks on this host when nproc > 1."""
    if nproc == 1:
        return [sys.executable, "-m", "gpn_scale"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), "-m", "gpn_scale"]


def process_env(**extra) -> dict:
    """The environment of a gpn-scale process a test starts: one thread (the suite's workers share the
    cores), wandb off, output unbuffered (a killed process's last lines are read)."""
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1", **extra)
