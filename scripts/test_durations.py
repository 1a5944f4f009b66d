"""tests/durations.json from a run of the suite: the seconds each test file took (setup, call and
teardown of its tests), by which tests/conftest.py sends the files to the suite's workers longest
first.

    ./scripts/test.sh --junitxml=/tmp/suite.xml
    python scripts/test_durations.py /tmp/suite.xml          # rewrites tests/durations.json

A file the table does not list (a new one) is estimated from its tests until the table is
rewritten; nothing fails on a stale table, the suite only runs longer.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tests" / "durations.json"


def file_seconds(junit_xml: Path) -> dict[str, float]:
    """{test file relative to the repository: seconds} from pytest's JUnit XML (its `time` is setup,
    call and teardown: junit_duration_report's default)."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "")
        # classname is the dotted path of the module (and class): tests.train.test_train[.Class]
        parts = module.split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        if not parts:
            continue
        name = "/".join(parts) + ".py"
        seconds[name] = seconds.get(name, 0.0) + float(case.get("time", 0.0))
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit_xml", type=Path, help="pytest --junitxml output of a whole run of the suite")
    ap.add_argument("--out", type=Path, default=TABLE)
    args = ap.parse_args(argv)
    try:
        seconds = file_seconds(args.junit_xml)
    except (OSError, ET.ParseError) as e:
        print(f"error: {args.junit_xml}: not a readable JUnit XML file ({e})", file=sys.stderr)
        return 2
    if not seconds:
        print(f"error: {args.junit_xml}: no test cases in it", file=sys.stderr)
        return 2
    table = {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])}
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{args.out}: {len(table)} files, {sum(table.values()) / 60:.1f} worker-minutes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
