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
