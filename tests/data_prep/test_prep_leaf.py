"""data_prep is a leaf: its whole run path works in a process where the training stack cannot be
imported, and loads none of it (nor gpn_scale, which imports data_prep, never the reverse)."""

import subprocess
import sys
from support import ROOT


SCRIPT = r'''
import json, sys

BLOCKED = ("deepspeed", "triton", "wandb", "gpn_scale")


class Hidden:
    """A finder of sys.meta_path that finds nothing of BLOCKED: each of them is as if not installed
    (torch's own check for Triton then says it is absent, as on a machine without it)."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [Hidden(finder) for finder in sys.meta_path]
from data_prep.cli import main
from data_prep.embedded import write_embedded_corpus

out = sys.argv[1]
files = [str(f) for f in write_embedded_corpus(f"{out}/corpus")]
codes = [main(["train-tokenizer", *files, "--vocab-size", "300", "--out", f"{out}/tok.json"]),
         main([*files[:-1], "--val-files", files[-1], "--out", f"{out}/prep", "--tokenizer", f"{out}/tok.json",
               "--seq-len", "64", "--workers", "1"])]
print(json.dumps({"codes": codes, "loaded": sorted({m.split(".")[0] for m in sys.modules} & set(BLOCKED))}))
'''


def test_prep_runs_where_the_training_stack_cannot_be_imported_and_loads_none_of_it(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"codes": [0, 0], "loaded": []}
    assert (tmp_path / "prep" / "stats.json").is_file() and (tmp_path / "prep" / "train" / "index.json").is_file()

