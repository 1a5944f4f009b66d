"""The suite's own arrangement under scripts/test.sh (pytest-xdist, `--dist loadgroup`)."""

import pytest


def test_a_files_tests_carry_its_group_into_the_id_the_scheduler_reads(request):
    """tests/conftest.py marks each file's tests with one xdist group, so a module-scoped fixture
    (a trained run, a cluster) is built on one worker only. xdist reads the group from a suffix of
    the test's id, which it adds itself; where it cannot (pytest 9.2's ids), every test is a group
    of its own and the fixtures are built once per worker, minutes of the suite's time."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("runs on an xdist worker under --dist loadgroup (scripts/test.sh)")
    assert request.node.nodeid.endswith("@test_suite_groups"), request.node.nodeid


def test_the_tests_mirror_the_packages():
    """A module's tests are found by its path: tests/<package>/ for each package of gpn_scale and for
    kernels, data_prep, launchers, bench and scripts; tests/support/ holds what test modules share, so
    no test module imports another; at the top, only the tests of the project as a whole."""
    import ast

    from support import ROOT

    tests = ROOT / "tests"
    packages = {p.name for p in (ROOT / "gpn_scale").iterdir() if (p / "__init__.py").is_file()}
    places = packages | {"kernels", "data_prep", "launchers", "bench", "scripts", "support"}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= places, sorted(folders - places)
    assert {p.name for p in tests.glob("test_*.py")} == {"test_cli.py", "test_demo.py", "test_layers.py",
                                                         "test_suite_groups.py", "test_wheel.py"}
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0].startswith("test_") for n in names), f"{path.relative_to(ROOT)}:{node.lineno}"
