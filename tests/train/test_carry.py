"""Carried state (train.carry_state): a window started from the state the previous one ended with
computes what one long window computes, and its gradient, with the state detached at the
boundary, is the naive core's truncated-BPTT gradient; the stream order of the batch slots; the
states saved per block of slots and loaded at another world size; the refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from data_prep.errors import UserError
from data_prep.document_streams import StreamLayout
from gpn_scale.train.carry import CarriedStates, plain, sample_at, training_layout

from support.carry_cases import CASES, GDN, make
from support.gpn_cases import ODD
from support import ROOT

pytestmark = pytest.mark.usefixtures("one_thread")
WINDOW, WINDOWS = 7, 3  # T = 7 is not a multiple of the core chunks below


def tokens(vocab, batch=2):
    return torch.randint(0, vocab, (batch, WINDOW * WINDOWS), generator=torch.Generator().manual_seed(3))


def windowed(model, x, carry=True, **kw):
    """Token losses of x read window by window, each from the state the last one ended with (or
    from the empty state), the state detached at each boundary as the trainer does."""
    state, losses = None, []
    for w in range(WINDOWS):
        out = model(x[:, w * WINDOW : (w + 1) * WINDOW], state=state, **kw)
        losses.append(out.token_losses)
        state = plain(out.state) if carry else None
    return torch.cat(losses, 1)


@pytest.mark.parametrize("case", [*CASES, "gdn"])
def test_carried_windows_compute_the_long_window(case):
    cfg = GDN if case == "gdn" else dataclasses.replace(ODD, **CASES[case])
    model = make(cfg)
    x = tokens(cfg.vocab_size)
    kw = {} if case == "gdn" else dict(core="fused")
    with torch.no_grad():
        whole = model(x, **kw).token_losses
        carried = windowed(model, x, **kw)
        fresh = windowed(model, x, carry=False, **kw)
    assert (carried - whole).abs().max().item() < 1e-10
    # from the empty state, each later window's first tokens are predicted without their past
    assert (fresh[:, WINDOW:] - whole[:, WINDOW:]).abs().max().item() > 1e-3
    assert torch.equal(fresh[:, :WINDOW], carried[:, :WINDOW])


@pytest.mark.parametrize("case", ["gpn_m_2l_chunk", "gdn"])
def test_the_carried_state_is_float32_under_bf16_autocast(case):
    """What a window hands the next (GDN: each layer's convolution buffer and S) is float32 whatever
    autocast computes in, with or without resets, and when it is carried on, as docs/train.md says."""
    cfg = GDN if case == "gdn" else dataclasses.replace(ODD, **CASES[case])
    model = make(cfg).float()
    x = tokens(cfg.vocab_size)
    kw = {} if case == "gdn" else dict(core="fused")
    resets = torch.zeros_like(x, dtype=torch.bool)
    resets[0, 3] = True

    def leaves(state):
        return [state] if isinstance(state, torch.Tensor) else [t for s in state if s is not None for t in leaves(s)]

    for extra in ({}, {"resets": resets[:, :WINDOW]}):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            state = plain(model(x[:, :WINDOW], **kw, **extra).state)
            floats = [t.dtype for t in leaves(state) if t.is_floating_point()]
            assert floats and set(floats) == {torch.float32}, (extra.keys(), floats)
            state = plain(model(x[:, WINDOW : 2 * WINDOW], state=state, **kw).state)
            assert {t.dtype for t in leaves(state) if t.is_floating_point()} == {torch.float32}


@pytest.mark.parametrize("case", CASES)
def test_carried_gradient_is_the_naive_truncated_bptt_gradient(case):
    """The fused core over carried, detached windows against the naive autograd loop over the long
    window with backpropagation cut every WINDOW steps (model.bptt)."""
    cfg = dataclasses.replace(ODD, **CASES[case])
    model, naive = make(cfg), make(dataclasses.replace(cfg, bptt=WINDOW, core="naive"))
    x = tokens(cfg.vocab_size)

    def grads(m, loss):
        m.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    weights = torch.linspace(0.5, 1.5, WINDOW * WINDOWS, dtype=torch.float64)  # every position's gradient counts
    ref = grads(naive, (naive(x).token_losses * weights).mean())
    got = grads(model, (windowed(model, x, core="fused") * weights).mean())
    errors = {n: ((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)).item() for n in ref}
    assert max(errors.values()) < 1e-10, errors
    # without the carried state the gradient is another one
    wrong = grads(model, (windowed(model, x, carry=False, core="fused") * weights).mean())
    assert max(((wrong[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref) > 1e-3


def test_each_slot_reads_its_streams_window_after_window():
    layout = StreamLayout(streams=6, windows_per_stream=4, seq_len=8)
    G = 3
    for slot in range(G):
        read = [divmod(sample_at(layout, t, slot, G), layout.streams) for t in range(2 * 2 * 4)]  # (window, stream)
        # stream `slot` to its end, then stream slot + G, then the order starts again
        expected = [(k, slot) for k in range(4)] + [(k, slot + G) for k in range(4)]
        assert read == expected * 2, slot


def test_states_saved_by_one_world_size_load_at_another(tmp_path):
    """Blocks of slots written by 2 ranks, read back by 1 and by 4: each rank gets its own slots'
    states, bitwise, whichever files hold them."""
    G, micro = 8, 2

    class Loader:  # what CarriedStates needs of StreamBatches: the slots of each micro-batch
        def __init__(self, world, rank):
            self.micro_batch, self.grad_accum = micro, G // (micro * world)
            self.first_slot = rank * G // world

        def slots(self, m):
            return range(self.first_slot + m * micro, self.first_slot + (m + 1) * micro)

    def state(slots):  # a GPN+M-like nest with each slot's own numbers, and a None
        s = torch.tensor([[float(j), j + 0.5] for j in slots])
        return (s, -s, torch.stack([torch.full((2, 3), float(j)) for j in slots]), None)

    for rank in range(2):
        carried = CarriedStates(Loader(2, rank))
        for m in range(carried.loader.grad_accum):
            carried.put(m, state(carried.loader.slots(m)))
        entries = carried.save(tmp_path)
        assert list(entries) == [f"carry_slots_{rank * 4:06d}-{rank * 4 + 4:06d}.pt"]
    for world in (1, 4):
        for rank in range(world):
            carried = CarriedStates(Loader(world, rank))
            carried.load(tmp_path, torch.device("cpu"))
            for m, got in enumerate(carried.states):
                want = state(carried.loader.slots(m))
                assert got[3] is None and all(torch.equal(a, b) for a, b in zip(got[:3], want[:3])), (world, rank, m)
    (tmp_path / "carry_slots_000004-000008.pt").unlink()
    with pytest.raises(UserError, match="no carried state for slots 4-8"):
        CarriedStates(Loader(1, 0)).load(tmp_path, torch.device("cpu"))


def test_stream_layout_refusals(tmp_path):
    with pytest.raises(UserError, match="no streams.json, so not the prep's streams"):
        training_layout(str(tmp_path), 4)
    (tmp_path / "streams.json").write_text(json.dumps({"streams": 6, "windows_per_stream": 3, "seq_len": 8}))
    with pytest.raises(UserError, match="6 streams .* are not a multiple of the global batch 4"):
        training_layout(str(tmp_path), 4)
    assert training_layout(str(tmp_path), 3) == StreamLayout(6, 3, 8)


def test_a_transformer_refuses_to_carry_state(tmp_path):
    from gpn_scale.train.config import load_train_config

    root = ROOT / "configs" / "train"
    with pytest.raises(UserError, match=r"^command-line override: train.carry_state: the transformer family carries no state"):
        load_train_config(root / "transformer_tiny.yaml", [f"run.dir={tmp_path}", "train.carry_state=true"])
    cfg = load_train_config(root / "gdn_tiny.yaml", [f"run.dir={tmp_path}", "train.carry_state=true"])
    assert cfg.train.carry_state


@pytest.mark.parametrize("overrides, message", [
    (["train.global_batch=3"], "data.train: 8 streams ("),
    (["data.train={windows}"], "no streams.json, so not the prep's streams"),
    (["model=transformer_tiny"], "train.carry_state: the transformer family carries no state"),
    (["model=transformer_tiny", "train.carry_state=false", "train.reset_on_eos=true"],
     "command-line override: train.reset_on_eos: the transformer family has no recurrent state to reset"),
    (["train.reset_on_eos=true"], "train.reset_on_eos: needs the EOS id, from the prep's stats.json beside data.train"),
])
def test_bad_carry_settings_are_one_line(tmp_path, capsys, overrides, message):
    from gpn_scale.cli import main
    from support.mds_fixture import write_streams, write_windows

    streams, windows = write_streams(tmp_path / "streams", 8, 2, 8, 64), write_windows(tmp_path / "windows", 4, 8, 64)
    config = ROOT / "configs" / "train" / "gpn_m_tiny.yaml"
    args = [f"run.dir={tmp_path / 'run'}", f"data.train={streams}", "data.val=null", "train.carry_state=true",
            "train.grad_accum=null", "train.micro_batch=1", *(o.format(windows=windows) for o in overrides)]
    assert main(["train", str(config), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()
