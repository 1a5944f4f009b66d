"""The decode step (gpn_scale/models/decode.py) against the full forward: logits at every position and
the carried state, in float64 to rounding, for GPN and GPN+M (1 and 2 layers) on every kernel that
runs here, Transformer++'s KV cache and Gated DeltaNet; greedy sequences identical; one forward and
one fused-weight build per generation, and per-token work that does not grow with the position."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from support.triton_kernels import interpreter  # noqa: F401  (the fixture: autouse; Triton's interpreter where no GPU)

import gpn_scale.models.decode as decode_mod
from gpn_scale.config import model_config
from gpn_scale.eval.generate import draw, generate_tokens
from gpn_scale.eval.harness import take_rows
from gpn_scale.models import GPN, GPNConfig, build_model
from gpn_scale.models.decode import decoder

# Odd sizes everywhere, as in test_fused_core.py.
ODD = GPNConfig(vocab_size=53, d_state=22, d_emb=9, d_ffn=15, n_heads=3, d_key=5, d_val=7, core_chunk=8)
GPN_CASES = {
    "gpn_1l": dict(family="gpn", n_layers=1),
    "gpn_2l": dict(family="gpn", n_layers=2, use_decoder_bias=True),
    "gpn_m_1l": dict(n_layers=1),
    "gpn_m_2l": dict(n_layers=2, use_decoder_bias=True),
}
KERNELS = ["torch", pytest.param("cpp", marks=pytest.mark.cpu_only)]


pytestmark = pytest.mark.usefixtures("one_thread")


def make_gpn(dtype=torch.float64, **changes):
    torch.manual_seed(0)
    model = GPN(dataclasses.replace(ODD, **changes)).to(dtype)
    with torch.no_grad():  # move the zero-initialised gates and FFN out-projection: every path live
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def decode_all(model, tokens: torch.Tensor, prompt: int):
    """Logits at positions prompt .. T of tokens (B, T) from prefill + one step per token, and the
    last decode state."""
    dec = decoder(model, tokens.shape[0])
    logits, ds = dec.prefill(tokens[:, :prompt])
    out = [logits]
    for t in range(prompt, tokens.shape[1]):
        logits, ds = dec.step(ds, tokens[:, t])
        out.append(logits)
    return torch.stack(out, 1), ds


def check_decode(model, tokens, prompts, tol):
    with torch.no_grad():
        full = model(tokens, return_logits=True, core="naive")  # the ground truth: the plain autograd loop
    for prompt in prompts:
        logits, ds = decode_all(model, tokens, prompt)
        torch.testing.assert_close(logits[:, :-1], full.logits[:, prompt:], **tol)
        assert logits.shape[1] == tokens.shape[1] - prompt + 1  # and one more: the token after the window
        for got, want in zip(ds.state, full.state):
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", sorted(GPN_CASES))
def test_gpn_decode_equals_the_forward_in_float64(case, kernel):
    """Every position's logits and the state after the last token, prompt lengths 0 and 7."""
    model = make_gpn(kernel=kernel, **GPN_CASES[case])
    check_decode(model, torch.randint(0, ODD.vocab_size, (3, 19)), (0, 7), dict(rtol=1e-12, atol=1e-12))


def test_gpn_decode_with_the_triton_kernels():
    """The GPU's kernels (in Triton's interpreter here: float32, a short window, it is slow)."""
    model = make_gpn(torch.float32, kernel="triton", n_layers=2)
    check_decode(model, torch.randint(0, ODD.vocab_size, (2, 6)), (2,), dict(rtol=1e-5, atol=1e-5))


@pytest.mark.parametrize("case", sorted(GPN_CASES))
def test_the_decode_state_continues_the_forward_and_after_it(case):
    """Resuming from the forward's state gives the forward's next logits; the forward continued from
    the decoder's state gives the decoder's."""
    model = make_gpn(**GPN_CASES[case])
    tokens = torch.randint(0, ODD.vocab_size, (2, 12))
    with torch.no_grad():
        full = model(tokens, return_logits=True)
        first = model(tokens[:, :5])
    dec = decoder(model, 2)
    logits, ds = dec.resume(first.state)
    torch.testing.assert_close(logits, full.logits[:, 5], rtol=1e-12, atol=1e-12)
    for t in range(5, 9):
        logits, ds = dec.step(ds, tokens[:, t])
    with torch.no_grad():
        rest = model(tokens[:, 9:], state=ds.state, return_logits=True)
    torch.testing.assert_close(logits, rest.logits[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rest.logits, full.logits[:, 9:], rtol=1e-12, atol=1e-12)


def test_rows_leave_the_batch_and_the_rest_decode_on_exactly():
    model = make_gpn(n_layers=2)
    tokens = torch.randint(0, ODD.vocab_size, (4, 10))
    with torch.no_grad():
        full = model(tokens, return_logits=True)
    dec = decoder(model, 4)
    logits, ds = dec.prefill(tokens[:, :3])
    rows = [0, 1, 2, 3]
    for t, keep in zip(range(3, 10), ([0, 1, 2, 3], [0, 2, 3], [0, 2, 3], [2, 3], [2, 3], [3], [3])):
        ds = take_rows(ds, [rows.index(r) for r in keep])
        rows = keep
        logits, ds = dec.step(ds, tokens[rows, t])
        torch.testing.assert_close(logits, full.logits[rows, t + 1] if t + 1 < 10 else logits, rtol=1e-12, atol=1e-12)


def greedy_by_forward(model, prompt: list[int], n: int) -> list[int]:
    """The definition: the argmax of the forward's logits after the whole sequence so far, re-run each time."""
    seq = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([seq + [0]]), return_logits=True).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("family", ["gpn_m", "gpn", "transformer", "gdn"])
def test_greedy_generation_is_the_forwards_argmax_sequence(family):
    """In float32, with the default kernels: what `gpn-scale generate --temperature 0` runs."""
    torch.manual_seed(0)
    if family.startswith("gpn"):
        model = make_gpn(torch.float32, family=family, n_layers=2, kernel="auto")
    else:
        model = build_model(model_config(f"{family}_tiny", {"vocab_size": 53})).eval()
        with torch.no_grad():  # away from the initialisation, whose near-uniform logits repeat one token
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
    prompt = [5, 9, 2, 44, 17]
    got = [t for t, _ in generate_tokens(model, prompt, 24, temperature=0)]
    assert got == greedy_by_forward(model, prompt, 24)
    assert len(set(got)) > 3  # not a constant sequence that anything would reproduce


@pytest.mark.parametrize("family", ["transformer", "gdn"])
def test_baseline_decoders_equal_the_forward_in_float64(family):
    torch.manual_seed(0)
    model = build_model(model_config(f"{family}_tiny", {"vocab_size": 61})).double().eval()
    tokens = torch.randint(0, 61, (2, 23))
    with torch.no_grad():
        full = model(tokens, return_logits=True)
    for prompt in (0, 6):
        dec = decoder(model, 2, new_tokens=3)  # the transformer's cache doubles several times on the way
        logits, ds = dec.prefill(tokens[:, :prompt])
        out = [logits]
        for t in range(prompt, tokens.shape[1] - 1):
            logits, ds = dec.step(ds, tokens[:, t])
            out.append(logits)
        torch.testing.assert_close(torch.stack(out, 1), full.logits[:, prompt:], rtol=1e-12, atol=1e-12)


def test_the_kv_cache_has_room_for_the_planned_tokens_and_grows_past_them():
    torch.manual_seed(0)
    model = build_model(model_config("transformer_tiny", {"vocab_size": 61})).eval()
    dec = decoder(model, new_tokens=5)
    logits, cache = dec.prefill(torch.randint(0, 61, (1, 7)))
    storage = cache.keys[0].data_ptr()
    for _ in range(5):
        logits, cache = dec.step(cache, logits.argmax(-1))
    assert cache.length == 1 + 7 + 5 and cache.keys[0].data_ptr() == storage  # start, the prompt, the steps: in place
    logits, cache = dec.step(cache, logits.argmax(-1))
    assert cache.keys[0].data_ptr() != storage and cache.keys[0].shape[2] >= cache.length


class OpShapes(TorchDispatchMode):
    """Every torch op dispatched, with the shapes of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["gpn_m", "gpn"])
def test_a_step_does_the_same_work_at_any_position(family):
    """O(1) per token: the ops of a step, and their shapes, are the same at step 3 and step 300; and
    the decode state does not grow."""
    model = make_gpn(torch.float32, family=family, n_layers=2, kernel="torch")
    dec = decoder(model)
    logits, ds = dec.prefill(torch.tensor([[1, 2, 3]]))
    traces, sizes = {}, {}
    for t in range(301):
        token = logits.argmax(-1)
        if t in (3, 300):
            with OpShapes() as mode:
                logits, ds = dec.step(ds, token)
            traces[t] = mode.ops
            sizes[t] = sum(x.numel() for x in torch.utils._pytree.tree_leaves(ds) if isinstance(x, torch.Tensor))
        else:
            logits, ds = dec.step(ds, token)
    assert traces[3] == traces[300] and len(traces[3]) > 10
    assert not any(name.startswith("aten.cat") for name, _ in traces[3])  # no weight fused inside a step
    assert sizes[3] == sizes[300]


def test_generation_runs_one_forward_and_fuses_the_weights_once(monkeypatch):
    model = make_gpn(torch.float32, n_layers=2, kernel="torch")
    calls = {"forward": 0, "fuse": 0}
    model.register_forward_pre_hook(lambda *_: calls.__setitem__("forward", calls["forward"] + 1))
    fuse = decode_mod.fuse_weights

    def counted(m):
        calls["fuse"] += 1
        return fuse(m)

    monkeypatch.setattr(decode_mod, "fuse_weights", counted)
    tokens = [t for t, _ in generate_tokens(model, [3, 4, 5], 40, temperature=0.8, seed=1)]
    assert len(tokens) == 40
    assert calls == {"forward": 1, "fuse": 1}  # the prompt's forward; then one decode step per token


def test_draw_samples_the_distribution_and_never_a_token_of_zero_mass():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.0, 0.05], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(probs, generator) for _ in range(20000)]), minlength=6).double()
    assert counts[1] == counts[4] == 0
    # 20000 draws: each frequency within 4 standard deviations of its probability
    sd = (probs * (1 - probs) / 20000).sqrt()
    assert ((counts / 20000 - probs).abs() <= 4 * sd + 1e-12).all(), counts / 20000
    one_hot = torch.zeros(6, dtype=torch.float64)
    one_hot[5] = 1
    assert {draw(one_hot, generator) for _ in range(100)} == {5}
