"""The fused core's graph path (kernels/graph.py), on CPU through the stand-in for CUDA graphs.

`CpuGraph` keeps what a real graph does to the memory its callers see: inputs reach a replay
only through the static buffers copied at each call, and every replay rewrites the same output
tensors, including any the caller kept. Under it the fused core with graphs must give what the
eager core gives, call after call, with gradient accumulation, across shape changes.
"""

import copy
import dataclasses
from typing import NamedTuple

import pytest
import torch

from gpn_scale.models import GPN, GPNConfig, GPNState
from kernels.graph import CPU_GRAPHS_ENV, CpuGraphs, Graphed, graphs_of

TINY = GPNConfig(vocab_size=41, d_state=14, d_emb=7, d_ffn=11, n_heads=2, d_key=3, d_val=5, core_chunk=4,
                 kernel="torch", cuda_graphs=True)
TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(autouse=True)
def _cpu_graphs(monkeypatch):
    monkeypatch.setenv(CPU_GRAPHS_ENV, "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors this small gain nothing from threads
    yield
    torch.set_num_threads(threads)


def pair(**changes):
    """(graphed, eager): the same float64 model, with graphs and without."""
    torch.manual_seed(0)
    graphed = GPN(dataclasses.replace(TINY, **changes)).double()
    with torch.no_grad():  # move the zero-initialised gates and FFN out-projection: every path live
        for p in graphed.parameters():
            p.add_(0.05 * torch.randn_like(p))
    eager = copy.deepcopy(graphed)
    eager.config = dataclasses.replace(graphed.config, cuda_graphs=False)
    return graphed, eager


def tokens(B, T, seed):
    return torch.randint(0, TINY.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def backward(model, toks, state=None):
    """Loss of a window, weighted unevenly over positions and including the carried state, so every
    output of the core (P, g, g_prev, M) sends a gradient back."""
    out = model(toks, state=state)
    w = torch.linspace(0.5, 1.5, toks.shape[1], dtype=out.token_losses.dtype)
    total = (out.token_losses * w).mean() + out.state.s.square().mean() + 0.5 * out.state.prev_s.square().mean()
    if out.state.M is not None:
        total = total + out.state.M.square().mean()
    total.backward()
    return out


def assert_same(graphed, eager, out_g, out_e):
    torch.testing.assert_close(out_g.token_losses, out_e.token_losses, **TOL)
    for a, b in zip(out_g.state, out_e.state):
        if b is not None:
            torch.testing.assert_close(a, b, **TOL)
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("form,projections", [("step", "recompute"), ("chunk", "recompute"), ("chunk", "keep")])
def test_consecutive_calls_replay_and_match_eager(form, projections):
    graphed, eager = pair(memory_form=form, core_projections=projections)
    for call in range(6):
        graphed.zero_grad(), eager.zero_grad()
        toks = tokens(3, 9, call)
        assert_same(graphed, eager, backward(graphed, toks), backward(eager, toks))
    g = graphs_of(graphed)
    # forward: eager, capture + replay, then replays; its backward starts a call later
    assert g.forward.stats == dict(eager=1, captured=1, replayed=5, failed=0)
    assert g.backward.stats == dict(eager=1, captured=1, replayed=4, failed=0)
    assert graphs_of(eager) is None


@pytest.mark.parametrize("micro,form", [(2, "step"), (4, "step"), (2, "chunk")])
def test_gradient_accumulation_sums_every_micro_batch(micro, form):
    graphed, eager = pair(memory_form=form)
    for step in range(3):
        graphed.zero_grad(), eager.zero_grad()
        # The incoming state is a leaf too: its gradients accumulate like the parameters'.
        states = [GPNState(*(x.clone().requires_grad_() for x in m.initial_state(2))) for m in (graphed, eager)]
        for k in range(micro):
            toks = tokens(2, 7, 100 * step + k)
            out_g, out_e = backward(graphed, toks, states[0]), backward(eager, toks, states[1])
        assert_same(graphed, eager, out_g, out_e)
        for a, b in zip(*states):
            torch.testing.assert_close(a.grad, b.grad, **TOL)
    assert graphs_of(graphed).backward.stats["replayed"] == 3 * micro - 2


def test_shape_change_and_back():
    graphed, eager = pair()
    for call, (B, T) in enumerate([(2, 9), (2, 9), (2, 9), (3, 5), (2, 9), (3, 5), (3, 5), (3, 5), (2, 9)]):
        graphed.zero_grad(), eager.zero_grad()
        toks = tokens(B, T, call)
        assert_same(graphed, eager, backward(graphed, toks), backward(eager, toks))
    stats = graphs_of(graphed).forward.stats
    assert stats == dict(eager=2, captured=2, replayed=7, failed=0)


@pytest.mark.parametrize("family,layers,form", [("gpn", 1, "step"), ("gpn_m", 1, "step"), ("gpn_m", 2, "step"), ("gpn_m", 2, "chunk")],
                         ids=["gpn", "gpn_m_1l", "gpn_m_2l", "gpn_m_2l_chunk"])
def test_families_with_truncated_bptt(family, layers, form):
    graphed, eager = pair(family=family, n_layers=layers, bptt=3, memory_form=form)
    for call in range(4):
        graphed.zero_grad(), eager.zero_grad()
        toks = tokens(2, 11, call)
        assert_same(graphed, eager, backward(graphed, toks), backward(eager, toks))
    assert graphs_of(graphed).backward.stats["replayed"] == 2


def test_second_forward_before_its_backward_is_a_one_line_error():
    graphed, _ = pair()
    for call in range(2):  # eager, then captured
        backward(graphed, tokens(2, 6, call))
    first, second = graphed(tokens(2, 6, 10)), graphed(tokens(2, 6, 11))
    with pytest.raises(RuntimeError, match="ran again before this backward") as e:
        (first.loss + second.loss).backward()
    assert "\n" not in str(e.value)


def test_no_graphs_without_the_switch(monkeypatch):
    monkeypatch.delenv(CPU_GRAPHS_ENV)
    graphed, eager = pair()
    graphed.zero_grad(), eager.zero_grad()
    assert_same(graphed, eager, backward(graphed, tokens(2, 5, 0)), backward(eager, tokens(2, 5, 0)))
    assert graphs_of(graphed) is None


# ---- the mechanism -----------------------------------------------------------------------------


def test_cpu_graph_rewrites_the_outputs_a_caller_kept():
    x = torch.arange(3.0)
    graph, out = CpuGraphs().capture(lambda a, b: (a * 2, [b, a + b]), (x, x + 1))
    assert out[0].isnan().all() and out[1][1].isnan().all()  # captured, not run
    assert out[1][0] is not None and not out[1][0].isnan().any()  # an input passed through stays the input
    graph.replay()
    kept = out[0]
    torch.testing.assert_close(kept, torch.tensor([0.0, 2, 4]))
    x.fill_(5)  # the graph reads its buffers where they are at replay
    graph.replay()
    assert kept is out[0]
    torch.testing.assert_close(kept, torch.tensor([10.0, 10, 10]))


def test_replays_read_inputs_only_through_the_static_buffers():
    calls = []
    g = Graphed(lambda scale, x: calls.append(x) or x * scale, "test", CpuGraphs())
    for k in range(4):
        x = torch.full((2,), float(k))
        y = g("key", (3.0,), (x,))
        torch.testing.assert_close(y, torch.full((2,), 3.0 * k))
        if k >= 1:
            assert calls[-1] is not x  # the static copy, never the caller's tensor
    assert g.stats == dict(eager=1, captured=1, replayed=3, failed=0)


class Config(NamedTuple):
    scale: float
    dtype: torch.dtype


def test_fixed_values_compare_by_value_and_tensors_by_identity():
    buf = torch.ones(2)
    g = Graphed(lambda cfg, b, x: x * cfg.scale + b, "test", CpuGraphs())
    for k in range(4):  # an equal config each call, a new object each call (as the core's Spec)
        y = g("key", (Config(2.0, torch.float64), buf), (torch.full((2,), float(k)),))
        torch.testing.assert_close(y, torch.full((2,), 2.0 * k + 1))
    assert g.stats["replayed"] == 3
    with pytest.raises(RuntimeError, match="fixed argument 1 is not the one its graph was captured with"):
        g("key", (Config(2.0, torch.float64), torch.ones(2)), (torch.zeros(2),))
