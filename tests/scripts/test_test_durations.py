"""scripts/test_durations.py: the seconds per test file, from a run's JUnit XML, for the order in
which tests/conftest.py sends the files to the suite's workers."""

import json
import subprocess
import sys

from support import ROOT

SCRIPT = ROOT / "scripts" / "test_durations.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.train.test_train" name="test_a" time="10.5" />
<testcase classname="tests.train.test_train" name="test_b[1]" time="4.25" />
<testcase classname="tests.test_demo" name="test_demo" time="80.0" />
<testcase classname="tests.eval.test_eval.TestPpl" name="test_c" time="2.0" />
<testcase classname="tests.eval.test_eval" name="test_d" time="1.0"><skipped /></testcase>
</testsuite></testsuites>
"""


def test_each_file_gets_its_tests_seconds_longest_first(tmp_path):
    xml, out = tmp_path / "suite.xml", tmp_path / "durations.json"
    xml.write_text(JUNIT)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(xml), "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    table = json.loads(out.read_text())
    assert table == {"tests/test_demo.py": 80.0, "tests/train/test_train.py": 14.8, "tests/eval/test_eval.py": 3.0}
    assert list(table) == ["tests/test_demo.py", "tests/train/test_train.py", "tests/eval/test_eval.py"]
    assert "3 files" in proc.stdout


def test_a_file_that_is_not_a_junit_report_is_one_line(tmp_path):
    for text in ("not xml <", "<testsuites></testsuites>"):
        xml = tmp_path / "suite.xml"
        xml.write_text(text)
        proc = subprocess.run([sys.executable, str(SCRIPT), str(xml), "--out", str(tmp_path / "d.json")],
                              capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {xml}: ") and len(proc.stderr.splitlines()) == 1
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "d.json").exists()


def test_the_table_lists_files_that_exist():
    """A renamed or deleted test file leaves the committed table: the writer is to be rerun."""
    table = json.loads((ROOT / "tests" / "durations.json").read_text())
    assert table and all((ROOT / name).is_file() for name in table), [n for n in table if not (ROOT / n).is_file()]
