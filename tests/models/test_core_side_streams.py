"""The fused core's reverse sweep on two streams: each chunk's weight gradients on a side stream,
beside the next chunk's sweep, through the CPU stand-in that checks a GPU's ordering rule."""

import dataclasses

import pytest
import torch

from kernels.graph import CpuGraphs
from kernels.side_streams import MAIN, SIDE, CpuLanes, OneLane, StreamRaceError
from support.gpn_cases import assert_same_grads, loss_and_grads, make

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {"gpn_2l": dict(family="gpn", n_layers=2), "gpn_m_1l_step": dict(n_layers=1, memory_form="step"),
         "gpn_m_2l_chunk": dict(n_layers=2, memory_form="chunk"), "gpn_m_1l_chunk_bptt": dict(n_layers=1, memory_form="chunk",
                                                                                          bptt=5),
         "gpn_m_2l_step_kept": dict(n_layers=2, memory_form="step", core_projections="keep")}


def on(model, lanes, graphs=None):
    """The model's fused core with these streams (and graph factory)."""
    backend = dataclasses.replace(model.backend("cpu"), lanes=lanes, graphs=graphs)
    model.backend = lambda device_type: backend
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_streams_equal_one_bitwise_and_the_naive_core_in_float64(case):
    tokens = torch.randint(0, 53, (3, 21), generator=torch.Generator().manual_seed(1))  # 3 chunks of 8
    model = make(torch.float64, **CASES[case])
    _, naive = loss_and_grads(model, tokens, "naive")
    one_out, one = loss_and_grads(on(make(torch.float64, **CASES[case]), OneLane()), tokens, "fused")
    two_out, two = loss_and_grads(on(make(torch.float64, **CASES[case]), CpuLanes()), tokens, "fused")
    assert torch.equal(one_out.loss, two_out.loss)
    assert all(torch.equal(one[n], two[n]) for n in one)
    assert_same_grads(two, naive, 1e-10)


class Dropping(CpuLanes):
    """The stand-in with the waits of one stream removed."""

    def __init__(self, stream: int):
        super().__init__()
        self.stream = stream

    def wait(self, event) -> None:
        if self.current != self.stream:
            super().wait(event)


@pytest.mark.parametrize("stream,what", [(SIDE, "reads what"), (MAIN, "overwrites what")])
def test_removing_an_event_between_the_streams_is_a_race(stream, what):
    """Without the side stream's wait for the sweep, its weight-gradient GEMMs read rows the
    sweep is writing; without the main stream's wait for the chunk before's gradients, the next
    chunk's buffers overwrite rows those GEMMs still read (or reuse their memory)."""
    tokens = torch.randint(0, 53, (2, 21), generator=torch.Generator().manual_seed(2))
    model = on(make(**CASES["gpn_m_2l_chunk"]), Dropping(stream))
    with pytest.raises(StreamRaceError, match=f"stream {stream}: .*({what}|reuses the memory)"):
        loss_and_grads(model, tokens, "fused")


def test_a_replayed_graph_with_two_streams_equals_one_stream_eagerly():
    """The graph stand-in captures the sweep with its fork, events and join; replays give the
    single-stream eager gradients bit for bit, window after window."""
    windows = [torch.randint(0, 53, (2, 21), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    eager = on(make(**CASES["gpn_m_2l_chunk"]), OneLane())
    graphed = on(make(**CASES["gpn_m_2l_chunk"]), CpuLanes(), CpuGraphs())
    for tokens in windows:  # eager, capture, replay, replay
        _, want = loss_and_grads(eager, tokens, "fused")
        _, got = loss_and_grads(graphed, tokens, "fused")
        assert all(torch.equal(got[n], want[n]) for n in want)
