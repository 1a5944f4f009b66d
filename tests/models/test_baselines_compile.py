"""The baselines' `model.compile` (each block through torch.compile: CPU inductor, real C++ kernels)
and `model.recompute` (each block's activations recomputed in the backward), each against the eager
model of the same weights; what is kept for the backward, read through autograd's saved-tensor hooks;
and the configs that refuse them."""

import dataclasses
import re

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from torch._dynamo.utils import counters

from gpn_scale.config import model_config
from data_prep.errors import UserError
from gpn_scale.models import MODEL_FAMILIES, GDNConfig, TransformerConfig, build_model
from gpn_scale.models.blocks import compile_blocks
from gpn_scale.train.config import load_train_config

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"transformer": TransformerConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, d_ffn=48),
        # one chunk of the delta rule's chunk form: each further chunk is the same ops unrolled again, a
        # fifth more compile time (the chunk form against the recurrent one: test_baselines.py)
        "gdn": GDNConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=2, d_key=8, d_val=12, d_ffn=48, chunk_size=8)}
TOKENS = (2, 8)


def run(model, tokens):
    """(output, parameter gradients, elements of the tensors other than parameters that the forward kept
    for the backward): what activation memory the model holds between its forward and backward."""
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in storages:
            kept.append(t.numel())
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}, sum(kept)


def twins(family, **changes):
    """The eager model and one with `changes`, of the same weights."""
    torch.manual_seed(0)
    eager = build_model(TINY[family])
    other = build_model(dataclasses.replace(TINY[family], **changes))
    other.load_state_dict(eager.state_dict())
    return eager, other


@pytest.mark.parametrize("family", TINY)
def test_recompute_gives_the_same_loss_and_gradients_and_keeps_only_the_blocks_inputs(family):
    """Bit for bit: on a CPU the recomputation runs the same kernels on the same inputs in the same
    order, so the activations it rebuilds are the ones the eager forward had."""
    eager, recomputed = twins(family, recompute=True)
    mixer_calls = []
    recomputed.layers[0].mixer.register_forward_hook(lambda *_: mixer_calls.append(torch.is_grad_enabled()))
    tokens = torch.randint(0, 61, TOKENS)
    out, grads, kept = run(eager, tokens)
    out_r, grads_r, kept_r = run(recomputed, tokens)
    assert mixer_calls == [True, True]  # the forward, and its recomputation in the backward
    assert torch.equal(out_r.loss, out.loss) and torch.equal(out_r.token_losses, out.token_losses)
    for name in grads:
        assert torch.equal(grads_r[name], grads[name]), name
    B, T = TOKENS
    blocks_inputs = len(recomputed.layers) * B * T * TINY[family].d_model
    assert blocks_inputs <= kept_r < kept / 4, (kept_r, kept)
    with torch.no_grad():  # nothing to recompute for: the block runs once
        recomputed(tokens)
    assert mixer_calls == [True, True, False]


@pytest.fixture(scope="module")
def cold_inductor(tmp_path_factory):
    """No compiled frame of another test, and an empty inductor cache: every graph here is traced and
    compiled afresh, so a test neither passes on nor waits for what an earlier run left behind.
    Inductor writes scalar C++ (cpp.vec_isa_ok off): half the compile time of its vectorised code on
    this machine (measured 17 s against 31 s for the Transformer's block), the same fused graph."""
    patch = pytest.MonkeyPatch()
    patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        yield
    torch._dynamo.reset()
    patch.undo()


@pytest.fixture(scope="module", params=list(TINY))
def compiled_and_eager(request, cold_inductor):
    """Per family, one compile: the blocks compiled and recomputed (the two keys together), run
    beside the eager model without recomputation, and the eager model with it; the dynamo counters
    of that compile."""
    family = request.param
    counters.clear()
    eager, compiled = twins(family, recompute=True)
    compile_blocks(compiled)
    _, recomputed = twins(family, recompute=True)
    tokens = torch.randint(0, 61, TOKENS)
    runs = {"eager": run(eager, tokens), "compiled": run(compiled, tokens), "recomputed": run(recomputed, tokens)}
    return family, compiled, runs, {k: dict(v) for k, v in counters.items()}


def test_compiled_blocks_give_the_eager_loss_and_gradients(compiled_and_eager):
    """Within 1e-5 of each tensor's largest value, in float32: inductor fuses the elementwise work
    and reorders its sums, so the last bits move (measured: 1e-6 at most)."""
    family, _, runs, _ = compiled_and_eager
    (out, grads, _), (out_c, grads_c, _) = runs["eager"], runs["compiled"]
    for name, a, b in [("loss", out_c.loss, out.loss), ("token_losses", out_c.token_losses, out.token_losses),
                       *((n, grads_c[n], grads[n]) for n in grads)]:
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), f"{family} {name}"


def test_every_block_runs_one_compiled_graph(compiled_and_eager):
    family, compiled, _, stats = compiled_and_eager
    assert all(layer._compiled_call_impl is not None for layer in compiled.layers)
    # both layers' calls went through the one graph compiled for the first: no graph breaks, no
    # second graph for the second layer
    assert stats["stats"]["unique_graphs"] == 1 and stats["frames"]["ok"] == 1, stats
    assert not stats.get("graph_break"), stats["graph_break"]
    assert stats["aot_autograd"]["ok"] == 1  # a forward and backward compiled together


def test_compiled_blocks_recompute_and_keep_what_eager_recomputation_keeps(compiled_and_eager):
    """The recomputation survives compilation: the compiled backward is given the blocks' inputs and
    rebuilds the rest, as the eager recomputation does, instead of the activations eager keeps."""
    _, _, runs, _ = compiled_and_eager
    kept = {name: r[2] for name, r in runs.items()}
    assert kept["compiled"] == kept["recomputed"] < kept["eager"] / 4, kept


def test_each_family_declares_how_it_compiles():
    assert MODEL_FAMILIES["transformer"].compile_forward is compile_blocks is MODEL_FAMILIES["gdn"].compile_forward
    assert MODEL_FAMILIES["gpn"].compile_forward is None and MODEL_FAMILIES["gpn_m"].compile_forward is None


@pytest.mark.parametrize("name", ["gpn_tiny", "gpn_m_tiny"])
@pytest.mark.parametrize("key", ["compile", "recompute"])
def test_gpn_families_have_no_compile_or_recompute_key(name, key):
    """GPN's fused core launches its own kernels and recomputes by its own keys (core_projections,
    recompute_every): a baseline's key there is an unknown key, not a silent no-op."""
    with pytest.raises(UserError, match=f"{key}: unknown key") as e:
        model_config(name, {key: True}, override_prefix="model.")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("on_command_line", [True, False])
def test_compile_under_zero3_is_refused_in_one_line(on_command_line, tmp_path):
    """ZeRO-3's gather hooks split a compiled block into many graphs (a 2-rank run: 47 graph breaks, torch's
    recompile limit hit), so the combination is refused before anything starts, and blamed where it was set."""
    model = dict(dataclasses.asdict(TINY["transformer"]), compile=not on_command_line)
    source = {"model": model, "run": {"dir": str(tmp_path / "run")}, "data": {"train": str(tmp_path)},
              "zero": {"stage": 2 if on_command_line else 3}}
    overrides = ["model.compile=true", "zero.stage=3"] if on_command_line else []
    with pytest.raises(UserError, match=re.escape("model.compile: true does not work with zero.stage=3")) as e:
        load_train_config(source, overrides)
    assert "\n" not in str(e.value) and "use zero.stage 0, 1 or 2" in str(e.value)
    assert str(e.value).startswith("command-line override" if on_command_line else "config")
    assert load_train_config(source, ["model.compile=true", "zero.stage=2"]).model.compile is True
