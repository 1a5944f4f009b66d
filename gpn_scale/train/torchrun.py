"""`python -m gpn_scale.train.torchrun [torchrun's arguments]`: torchrun, ending a refusal as
`gpn-scale train` ends it.

The launchers (launchers/torchrun.sh, launchers/elastic.sh, launchers/slurm/train.sbatch and
`gpn-scale launch`) start the ranks through it. torchrun reports any failed worker as its
ChildFailedError traceback and exit status 1. Here, when the first worker to fail exited with 2
(bad input: rank 0 printed the one line; the others refused alike or were stopped by the agent),
it exits with 2 and adds nothing: neither the traceback nor the agent's log lines about that
failure. Every other outcome is torchrun's own, its output included.

It also turns off torch's sharing of the rendezvous store with the workers
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, unless set): with sharing, rank 0 publishes the workers'
store address in the first round only, so a node that joins a running elastic job (a scale-up,
or a replaced node rejoining after the round closed) waits for it forever and both agents end in a
store timeout. Without it rank 0 publishes a fresh address every round, as torch did before 2.5.
"""

from __future__ import annotations

import logging
import os
import sys

REFUSED = 2  # gpn_scale.cli's exit status for a UserError
_API = "torch.distributed.elastic.multiprocessing.api"  # whose logger reports a worker group's end


class _HeldForTheVerdict(logging.Filter):
    """The agent's lines about a failed worker group (the closing signals it sends the survivors,
    then `failed (exitcode: N) ...`), held back until the exit code is known: dropped for a
    refusal, passed on (in their order) for anything else."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.logger, self.held = logger, []

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "gpn_released", False):
            return True
        text = record.msg if isinstance(record.msg, str) else ""
        if text.startswith("Sending process"):
            self.held.append(record)
            return False
        if text.startswith("failed (exitcode:"):
            refused = bool(record.args) and record.args[0] == REFUSED
            if refused:
                self.held.clear()
                return False
            self.release()
        return True

    def release(self) -> None:
        held, self.held = self.held, []
        for record in held:
            record.gpn_released = True
            self.logger.handle(record)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    logger = logging.getLogger(_API)
    held = _HeldForTheVerdict(logger)
    logger.addFilter(held)
    try:
        torchrun(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as e:
        _, first = e.get_first_failure()
        if first.exitcode == REFUSED:
            return REFUSED
        raise
    finally:
        held.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
