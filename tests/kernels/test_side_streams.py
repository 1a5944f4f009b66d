"""kernels/side_streams.py: the CPU stand-in for a side stream reports what a GPU would race on."""

import pytest
import torch

from kernels.side_streams import CpuLanes, OneLane, StreamRaceError


def test_a_read_on_the_side_stream_needs_an_event_after_the_write():
    lanes = CpuLanes()
    x = torch.zeros(8)
    lanes.fork()
    x.add_(1.0)  # main writes x after the fork
    with lanes.side():
        with pytest.raises(StreamRaceError, match="reads what add_ on stream 0 wrote"):
            x.sum()
    lanes.join()

    lanes = CpuLanes()
    lanes.fork()
    x.add_(1.0)
    done = lanes.record()
    with lanes.side():
        lanes.wait(done)
        assert x.sum().item() == 16.0  # ordered: fine
    lanes.join()


def test_main_may_not_overwrite_or_reuse_what_the_side_stream_reads_before_waiting_for_it():
    lanes = CpuLanes()
    x = torch.ones(8)
    lanes.fork()
    with lanes.side():
        y = x * 2
        read = lanes.record()
    with pytest.raises(StreamRaceError, match="overwrites what mul on stream 1 read"):
        x.zero_()
    lanes.join()
    x.zero_()  # after the join: ordered

    lanes = CpuLanes()
    x = torch.ones(8)
    lanes.fork()
    with lanes.side():
        y = x * 2
        read = lanes.record()
    lanes.wait(read)
    x.zero_()
    lanes.join()
    assert y.sum().item() == 16.0


def test_memory_a_stream_made_is_not_reused_by_it_while_the_other_stream_may_still_read_it():
    """CUDA's caching allocator hands a freed block back to the stream that made it at once: a new
    output there while the other stream's read is not ordered before it is a race. The CPU's
    allocator also hands the other stream's blocks around, which on a GPU cannot happen: no race.
    (Driven through `access` with explicit addresses: the CPU allocator's reuse is not predictable.)"""
    lanes = CpuLanes(check=False)
    lanes.fork()
    lanes.access("fill_", [], [], [0x1000])  # main makes a block
    done = lanes.record()
    with lanes.side():
        lanes.wait(done)
        lanes.access("sum", [0x1000], [], [0x2000])  # the side stream reads it, and makes one of its own
    with pytest.raises(StreamRaceError, match="stream 0: full reuses the memory of what sum on stream 1 read"):
        lanes.access("full", [], [], [0x1000])
    lanes.access("full", [], [], [0x2000])  # the side stream's block: the CPU allocator's doing, not a reuse
    with lanes.side():
        finished = lanes.record()
    lanes.wait(finished)
    lanes.access("full", [], [], [0x1000])  # after waiting for the side stream: fine
    lanes.join()


def test_one_lane_runs_everything_in_order():
    lanes, x = OneLane(), torch.zeros(4)
    lanes.fork()
    with lanes.side():
        x.add_(1.0)
    lanes.wait(lanes.record())
    lanes.join()
    assert x.sum().item() == 4.0
