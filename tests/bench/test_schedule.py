"""bench/schedule.py: kernels on streams, the overlap rule's bounds, and one stream as a serial sum."""

import random

import pytest

from bench.schedule import Node, critical_path, wave_share


def random_node(rng, stream, waits=()):
    seconds = rng.uniform(0.5e-6, 50e-6)
    sms = rng.choice([1.0, rng.uniform(0.05, 1.0)])
    bound = rng.random()
    # alone, a kernel uses at most its SMs' share of bandwidth and arithmetic, and is bound by one of them
    bandwidth, compute = (sms, rng.uniform(0, sms)) if bound < 0.5 else (rng.uniform(0, sms), sms)
    return Node(f"k{rng.random():.3f}", stream, seconds, bandwidth, compute, sms, waits, gap=rng.choice([0.0, 1.5e-6]))


def test_one_stream_is_the_serial_sum_of_times_and_gaps():
    rng = random.Random(0)
    for _ in range(50):
        nodes = [random_node(rng, 0) for _ in range(rng.randint(1, 40))]
        assert critical_path(nodes) == pytest.approx(sum(n.gap + n.seconds for n in nodes), rel=1e-12)


def test_kernels_together_never_take_less_than_the_resources_they_share():
    """Two or more streams: no less than each kernel alone, than the sum of bandwidth-seconds,
    of compute-seconds and of SM-seconds (the overlap rule's three shared resources), and no
    more than the serial sum."""
    rng = random.Random(1)
    for _ in range(200):
        nodes = [dataclass_no_gap(random_node(rng, rng.randint(0, 2))) for _ in range(rng.randint(2, 12))]
        span = critical_path(nodes)
        for share in ("bandwidth", "compute", "sms"):
            assert span >= sum(getattr(n, share) * n.seconds for n in nodes) * (1 - 1e-9)
        per_stream = {}
        for n in nodes:
            per_stream[n.stream] = per_stream.get(n.stream, 0.0) + n.seconds
        assert span >= max(per_stream.values()) * (1 - 1e-9)
        assert span <= sum(n.seconds for n in nodes) * (1 + 1e-9)


def dataclass_no_gap(n: Node) -> Node:
    return Node(n.name, n.stream, n.seconds, n.bandwidth, n.compute, n.sms, n.waits, 0.0)


def test_a_bandwidth_bound_kernel_beside_a_gemm_with_sms_to_spare():
    """A memory kernel on half the SMs beside a compute-bound GEMM whose tiles fill the other half:
    they share only the bus, 100% + 20% of it, so together they take 1.2 times one of them."""
    memory = Node("memory", 0, 10e-6, bandwidth=0.5, compute=0.0, sms=0.5)
    gemm = Node("gemm", 1, 10e-6, bandwidth=0.1, compute=0.5, sms=0.5)
    assert critical_path([memory, gemm]) == pytest.approx(10e-6)
    full = Node("memory", 0, 10e-6, bandwidth=1.0, compute=0.0, sms=1.0)
    assert critical_path([full, gemm]) == pytest.approx(15e-6)  # SMs: 1 + 0.5
    # a GEMM filling the GPU leaves nothing to overlap with: the serial sum
    big = Node("gemm", 1, 10e-6, bandwidth=0.2, compute=1.0, sms=1.0)
    assert critical_path([full, big]) == pytest.approx(20e-6)


def test_a_wait_orders_two_streams():
    a = Node("a", 0, 10e-6, 0.5, 0.0, 0.5)
    b = Node("b", 1, 10e-6, 0.1, 0.5, 0.5)
    assert critical_path([a, b]) == pytest.approx(10e-6)
    assert critical_path([a, Node("b", 1, 10e-6, 0.1, 0.5, 0.5, waits=(0,))]) == pytest.approx(20e-6)
    # stream 0's second kernel waits for stream 1's, which waits for stream 0's first: a chain
    nodes = [a, Node("b", 1, 5e-6, 0.1, 0.5, 0.5, waits=(0,)), Node("c", 0, 5e-6, 0.5, 0.0, 0.5, waits=(1,))]
    assert critical_path(nodes) == pytest.approx(20e-6)
    with pytest.raises(ValueError, match="only earlier nodes"):
        critical_path([Node("a", 0, 1e-6, waits=(1,)), Node("b", 1, 1e-6)])


def test_wave_share():
    assert wave_share(132, 132) == 1.0 and wave_share(264, 132) == 1.0
    assert wave_share(66, 132) == 0.5
    assert wave_share(133, 132) == pytest.approx(133 / 264)  # a second wave of one tile
