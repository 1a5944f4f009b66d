"""A real one-node SLURM cluster (munged, slurmctld, slurmd) in a temporary directory, for tests.

Debian's slurm-wlm and munge packages provide the daemons (scripts/test.sh installs them where it
can). Everything lives under the given directory: config, state, logs, the munge key and socket;
ports are picked free, so it does not collide with a system SLURM.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from support import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")


def available() -> bool:
    return all(shutil.which(d) or Path("/usr/sbin", d).exists() for d in DAEMONS)


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname()
        self.procs: list[subprocess.Popen] = []
        (root / "munge").mkdir(parents=True, mode=0o700)
        for sub in ("state", "spool", "log"):
            (root / sub).mkdir()
        self.socket = root / "munge" / "munge.socket"
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self) -> "Cluster":
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        subprocess.run([_binary("munged"), "--force", f"--key-file={key}", f"--socket={self.socket}",
                        f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                        f"--log-file={self.root / 'log' / 'munged.log'}",
                        f"--seed-file={self.root / 'munge' / 'seed'}"], check=True)
        user, cpus = getpass.getuser(), os.cpu_count() or 1
        r = self.root
        self.conf.write_text(f"""\
ClusterName=gpnscaletest
SlurmctldHost={self.host}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=10
NodeName={self.host} CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        for daemon in ("slurmctld", "slurmd"):  # -D: stay in the foreground, so the test owns them
            log = open(self.root / "log" / f"{daemon}.out", "w")
            self.procs.append(subprocess.Popen([_binary(daemon), "-D", "-f", str(self.conf)], env=self.env,
                                               stdout=log, stderr=subprocess.STDOUT))
        deadline = time.time() + 60
        while time.time() < deadline:
            out = self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
            if out == "idle":
                return self
            time.sleep(1)
        raise RuntimeError(f"slurm did not come up; see {self.root / 'log'}")

    def run(self, *cmd: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env={**self.env, **(env or {})}, capture_output=True, text=True, check=check,
                              timeout=60)

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict of its KEY=VALUE fields."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        pid_file = self.root / "munge" / "munged.pid"
        if pid_file.exists():
            subprocess.run(["kill", pid_file.read_text().strip()], check=False)
