"""The native model against its definition (docs/model.md, via tests/support/reference_gpn.py):
reference-format checkpoints in, the same numbers out."""

import pickle
import zlib

import numpy as np
import pytest
import torch

import support.reference_checkpoint as reference_checkpoint
import support.reference_gpn as reference_gpn
from gpn_scale.export.convert import from_reference, load_reference_pickle, to_reference
from data_prep.errors import UserError

TINY = dict(vocab_size=37, d_state=24, d_emb=12, d_ffn=20)
MEM = dict(n_heads=3, d_key=6, d_val=5)
CASES = {
    "gpn": (dict(TINY), False),
    "gpn_m_1l": (dict(TINY, **MEM), True),
    "gpn_m_2l": (dict(TINY, **MEM, n_layers=2), True),
    "gpn_m_bias": (dict(TINY, **MEM, use_decoder_bias=True), True),
}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


@pytest.fixture(params=sorted(CASES))
def reference(request, tmp_path):
    model_cfg, memory = CASES[request.param]
    rng = np.random.default_rng(zlib.crc32(request.param.encode()))  # str hash() differs per process
    params = reference_gpn.random_params(model_cfg, memory, rng)
    ckpt, config = reference_checkpoint.write(tmp_path / "run", params, model_cfg)
    tokens = rng.integers(0, model_cfg["vocab_size"], size=(3, 9))
    tokens2 = rng.integers(0, model_cfg["vocab_size"], size=(3, 7))
    return dict(params=params, cfg=model_cfg, memory=memory, ckpt=ckpt, config=config, tokens=tokens, tokens2=tokens2)


def test_loss_logits_and_state_match_reference(reference):
    model = from_reference(reference["ckpt"], reference["config"])
    assert model.config.memory == reference["memory"]
    tokens = torch.from_numpy(reference["tokens"])
    with torch.no_grad():
        out = model(tokens, return_logits=True)
    ref_loss, ref_logits, ref_state = reference_gpn.forward(reference["params"], reference["cfg"], reference["tokens"])
    assert rel_err(out.loss.item(), ref_loss) < 1e-5
    assert rel_err(out.logits.numpy(), ref_logits) < 1e-5
    assert rel_err(out.state.s.numpy(), ref_state[0]) < 1e-5
    assert rel_err(out.state.prev_s.numpy(), ref_state[1]) < 1e-5
    if reference["memory"]:
        assert rel_err(out.state.M.numpy(), ref_state[2]) < 1e-5
        assert np.abs(ref_state[2]).max() > 1e-3  # the memory really was written
    else:
        assert out.state.M is None

    # Continuing the stream from the carried state reproduces the reference's second window.
    with torch.no_grad():
        out2 = model(torch.from_numpy(reference["tokens2"]), state=out.state)
    ref_loss2, _, _ = reference_gpn.forward(reference["params"], reference["cfg"], reference["tokens2"], ref_state)
    assert rel_err(out2.loss.item(), ref_loss2) < 1e-5
    fresh_loss2, _, _ = reference_gpn.forward(reference["params"], reference["cfg"], reference["tokens2"])
    assert abs(fresh_loss2 - ref_loss2) > 1e-4  # the state matters, so the check above means something


def test_gradients_match_reference_finite_differences(reference):
    """float64 autograd == directional finite differences of the reference; float32 export == float64."""
    tokens = torch.from_numpy(reference["tokens"])
    model32 = from_reference(reference["ckpt"], reference["config"])
    model32(tokens).loss.backward()
    grads32 = to_reference(model32, grads=True)
    model64 = from_reference(reference["ckpt"], reference["config"]).double()
    model64(tokens).loss.backward()
    grads64 = to_reference(model64, grads=True)
    assert all(v.dtype == np.float64 for v in grads64.values())
    assert set(grads32) == set(reference["params"])

    rng = np.random.default_rng(1)
    params64 = {k: v.astype(np.float64) for k, v in reference["params"].items()}
    for name, value in params64.items():
        direction = rng.standard_normal(value.shape)

        def loss_at(h):
            shifted = dict(params64)
            shifted[name] = value + h * direction
            return reference_gpn.forward(shifted, reference["cfg"], reference["tokens"])[0]

        analytic = float((grads64[name] * direction).sum())
        # The loss is only piecewise smooth (relu on k and q): a step that crosses a kink gives a wrong
        # difference quotient, so several step sizes are tried and the closest must agree. A wrong
        # gradient disagrees with all of them.
        fds = [(loss_at(eps) - loss_at(-eps)) / (2 * eps) for eps in (1e-5, 1e-6, 1e-7, 1e-8)]
        err = min(abs(analytic - fd) / max(abs(fd), 1e-3) for fd in fds)
        assert err <= 1e-6, (name, analytic, fds)
        assert rel_err(grads32[name], grads64[name]) < 1e-4, name


def test_to_reference_roundtrips_the_checkpoint(reference):
    model = from_reference(reference["ckpt"], reference["config"])
    exported = to_reference(model)
    assert set(exported) == set(reference["params"])
    for name, value in reference["params"].items():
        np.testing.assert_array_equal(exported[name], value)


def test_loader_skips_optimizer_state_without_optax(reference):
    payload = load_reference_pickle(reference["ckpt"] / "checkpoint.pkl")
    assert payload["step"] == 100 and payload["data_position"] == 12345
    assert "inert optax._src.transform.ScaleByAdamState" in repr(payload["opt_state"][0])
    import sys

    assert "optax" not in sys.modules


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("where", ["params", "opt_state"])
def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path, where):
    marker = tmp_path / "pwned"
    payload = {"step": 1, "params": {"embedding": np.zeros((2, 2), np.float32)}, "opt_state": ()}
    if where == "params":
        payload["params"]["evil"] = _Evil(marker)
    else:
        payload["opt_state"] = (_Evil(marker),)
    (tmp_path / "checkpoint.pkl").write_bytes(pickle.dumps(payload))
    with pytest.raises(UserError, match=r"refusing to load: the pickle asks for (posix|os|nt)\.system"):
        load_reference_pickle(tmp_path)
    assert not marker.exists()


def test_builtin_callables_are_refused(tmp_path):
    class CallsEval:
        def __reduce__(self):
            return eval, ("1+1",)

    (tmp_path / "checkpoint.pkl").write_bytes(pickle.dumps({"params": {"x": CallsEval()}}))
    with pytest.raises(UserError, match="builtins.eval"):
        load_reference_pickle(tmp_path)


def test_mismatched_checkpoint_and_config_errors(reference, tmp_path):
    import json

    cfg = dict(reference["cfg"], d_state=reference["cfg"]["d_state"] + 1)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": cfg}))
    with pytest.raises(UserError, match="shape"):
        from_reference(reference["ckpt"], bad)
    truncated = tmp_path / "trunc"
    truncated.mkdir()
    data = (reference["ckpt"] / "checkpoint.pkl").read_bytes()
    (truncated / "checkpoint.pkl").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="not a readable reference checkpoint"):
        from_reference(truncated, reference["config"])
