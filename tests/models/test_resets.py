"""The state reset at documents' ends (train.reset_on_eos): with `resets`, a window reads each
document after an EOS as if it started from the empty state, and the first from the state it was
given; its gradient is the step-by-step one with the state replaced at each EOS and cut at the
absolute multiples of bptt; the refusals."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from gpn_scale.models import GPNState
from gpn_scale.models.resets import pieces, where_rows
from gpn_scale.train.carry import plain, rows

from support.carry_cases import CASES, GDN, make
from support.gpn_cases import ODD

pytestmark = pytest.mark.usefixtures("one_thread")
EOS, T = 2, 13
# per row, the positions holding EOS: several, none, at the window's first and last position, adjacent
ENDS = ([3, 7], [], [0, 12], [5, 6, 11])


def config(case):
    return GDN if case == "gdn" else dataclasses.replace(ODD, **CASES[case])


def window(vocab, seed=4):
    x = torch.randint(3, vocab, (len(ENDS), T), generator=torch.Generator().manual_seed(seed))
    for row, ends in enumerate(ENDS):
        x[row, ends] = EOS
    return x


def documents(row: torch.Tensor) -> list[torch.Tensor]:
    """A row cut after each EOS."""
    cuts = [0] + [t + 1 for t in range(len(row)) if row[t] == EOS]
    return [row[a:b] for a, b in zip(cuts, cuts[1:] + [len(row)]) if b > a]


def kw(case):
    return {} if case == "gdn" else dict(core="fused")


def carried_in(model, case):
    """A state some earlier window left (not the empty one), as the trainer carries it."""
    with torch.no_grad():
        return plain(model(window(config(case).vocab_size, seed=9), **kw(case)).state)


def leaves(state) -> list[torch.Tensor]:
    if state is None:
        return []
    return [state] if isinstance(state, torch.Tensor) else [t for s in state for t in leaves(s)]


def is_empty(model, state) -> bool:
    empty = model.initial_state(1)
    return all(torch.equal(a.to(b.dtype), b) for a, b in zip(leaves(empty), leaves(state), strict=True))


@pytest.mark.parametrize("case", [*CASES, "gdn"])
def test_each_document_after_an_eos_starts_from_the_empty_state(case):
    model = make(config(case))
    x = window(config(case).vocab_size)
    state = carried_in(model, case)
    with torch.no_grad():
        out = model(x, state=state, resets=x == EOS, **kw(case))
        for i, row in enumerate(x):
            losses, s = [], rows(state, i, i + 1)
            for doc in documents(row):
                o = model(doc[None], state=s, **kw(case))
                losses.append(o.token_losses)
                s = None if doc[-1] == EOS else plain(o.state)
            assert (torch.cat(losses, 1) - out.token_losses[i]).abs().max().item() < 1e-10, (case, i)
            final = rows(plain(out.state), i, i + 1)
            if s is None:  # the row ended with EOS: the next window starts it from the empty state
                assert is_empty(model, final)
            else:
                for a, b in zip(leaves(s), leaves(final), strict=True):
                    assert (a.double() - b.double()).abs().max().item() < 1e-10
        # without the resets the documents after an EOS read their predecessors' state
        kept = model(x, state=state, **kw(case)).token_losses
    assert (kept[0, 4:] - out.token_losses[0, 4:]).abs().max().item() > 1e-3
    assert (kept[1] - out.token_losses[1]).abs().max().item() < 1e-10  # no EOS in row 1: the same losses


def stepwise(model, x, state, bptt):
    """The reference: one token per call, the state replaced by the empty one after each EOS (its
    rows only) and detached at every multiple of bptt, counted from the window's start."""
    losses = []
    for t in range(x.shape[1]):
        if bptt and t and t % bptt == 0:
            state = plain(state)
        out = model(x[:, t : t + 1], state=state, core="naive")
        losses.append(out.token_losses)
        state = where_rows(x[:, t] == EOS, model.initial_state(x.shape[0]), GPNState(*out.state))
    return torch.cat(losses, 1)


@pytest.mark.parametrize("case", ["gpn_1l", "gpn_m_1l_step", "gpn_m_2l_chunk"])
@pytest.mark.parametrize("bptt", [0, 5])  # 5: cuts where no piece ends
def test_the_fused_gradient_is_the_stepwise_gradient(case, bptt):
    cfg = dataclasses.replace(config(case), bptt=bptt)
    model = make(cfg)
    x = window(cfg.vocab_size)
    state = carried_in(model, case)
    weights = torch.linspace(0.5, 1.5, T, dtype=torch.float64)

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = grads((stepwise(model, x, state, bptt) * weights).mean())
    got = grads((model(x, state=state, resets=x == EOS, core="fused").token_losses * weights).mean())
    errors = {n: ((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)).item() for n in ref}
    assert max(errors.values()) < 1e-10, errors
    unreset = grads((model(x, state=state, core="fused").token_losses * weights).mean())
    assert max(((unreset[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref) > 1e-3


def test_gdn_gradient_is_the_per_document_gradient():
    model = make(GDN)
    x = window(GDN.vocab_size)

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    got = grads(model(x, resets=x == EOS).token_losses.sum())
    ref = grads(sum(model(doc[None]).token_losses.sum() for row in x for doc in documents(row)))
    errors = {n: ((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)).item() for n in ref}
    assert max(errors.values()) < 1e-10, errors


def test_pieces_cut_after_each_eos_and_at_the_multiples_of_bptt():
    resets = torch.zeros(2, 10, dtype=torch.bool)
    resets[0, 2] = resets[1, 2] = resets[1, 6] = resets[0, 9] = True
    got = [(p.start, p.stop, None if p.reset is None else p.reset.tolist(), p.cut) for p in pieces(resets, bptt=4)]
    assert got == [(0, 3, [True, True], False), (3, 4, None, True), (4, 7, [False, True], False),
                   (7, 8, None, True), (8, 10, [True, False], False)]
    with pytest.raises(ValueError, match="resets: expected a bool tensor shaped like the tokens"):
        make(config("gpn_1l"))(window(ODD.vocab_size), resets=torch.zeros(2, 3, dtype=torch.bool))


def test_pieces_of_one_length_train_under_graphs(monkeypatch):
    """Under the fused core's graphs (the CPU stand-in), a window whose pieces repeat a length would
    replay a forward graph over the buffers an earlier piece's backward still needs: the pieces
    run without graphs, and the gradient is the one without graphs."""
    from kernels.graph import CPU_GRAPHS_ENV

    cfg = dataclasses.replace(config("gpn_m_1l_step"), cuda_graphs=True)
    x = window(cfg.vocab_size)  # pieces [0, 1), [1, 4), [4, 6), [6, 7), [7, 8), ...: lengths repeat

    def grads(model):
        model.zero_grad()
        model(x, resets=x == EOS, core="fused").loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = grads(make(cfg))
    monkeypatch.setenv(CPU_GRAPHS_ENV, "1")
    model = make(cfg)
    assert model.backend("cpu").graphs is not None
    for _ in range(3):  # eager, capture, replay: each would meet the repeated lengths
        got = grads(model)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_the_resets_bench_times_both_steps_and_counts_the_pieces():
    import os
    import re
    import subprocess

    from support import ROOT

    sys.path.insert(0, str(ROOT))
    from bench.resets import document_ends

    ends = document_ends(3, 200, 10.0)
    assert ends.shape == (3, 200) and 30 < int(ends.sum()) < 90  # about 200 / 11 per row
    assert torch.equal(ends, document_ends(3, 200, 10.0))  # seeded
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "resets.py"), "--config", "gpn_m_tiny", "--batch", "2",
                           "--seq-len", "24", "--doc-len", "6", "--rounds", "1"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"(\d+) documents' ends at (\d+) distinct positions: (\d+) pieces", proc.stdout)
    assert m and int(m[2]) >= 2 and int(m[3]) in (int(m[2]), int(m[2]) + 1), proc.stdout
    assert re.search(r"reset / whole: \d+\.\d\dx the time", proc.stdout), proc.stdout


def test_a_window_without_eos_runs_whole_and_returns_its_state_attached(monkeypatch):
    """With bptt, a window holding no EOS is still one run of the loop (graphs included), and no
    window's returned state is cut at its end, as without resets (the caller detaches it)."""
    from kernels.graph import CPU_GRAPHS_ENV

    monkeypatch.setenv(CPU_GRAPHS_ENV, "1")
    cfg = dataclasses.replace(config("gpn_m_1l_step"), bptt=4, cuda_graphs=True)
    model = make(cfg)
    x = window(cfg.vocab_size)[:, :12]  # T = 12, a multiple of bptt
    x[x == EOS] = EOS + 1
    calls = []
    monkeypatch.setattr(model, "_recurrence", lambda *a, **k: calls.append(a[0].shape[1]) or type(model)._recurrence(model, *a, **k))
    plain_out = model(x, core="fused")
    reset_out = model(x, resets=x == EOS, core="fused")
    assert calls == [12, 12]  # one call each, over the whole window
    assert torch.equal(plain_out.token_losses, reset_out.token_losses)
    assert reset_out.state.s.grad_fn is not None and reset_out.state.M.grad_fn is not None
    x[0, 5] = EOS
    calls.clear()
    out = model(x, resets=x == EOS, core="fused")
    assert calls == [4, 2, 2, 4]  # cut after the EOS and at 4 and 8
    assert out.state.s.grad_fn is not None and out.state.M.grad_fn is not None
