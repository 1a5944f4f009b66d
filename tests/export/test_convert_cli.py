"""`gpn-scale convert`: a reference checkpoint becomes a native one that loads to the same model."""

import numpy as np
import pytest
import torch
import yaml

import support.reference_checkpoint as reference_checkpoint
import support.reference_gpn as reference_gpn
from gpn_scale.cli import main as cli
from gpn_scale.export.convert import from_reference
from data_prep.errors import UserError
from gpn_scale.storage.checkpoints import load_native
from gpn_scale.storage.native import add_manifest, save_native


def test_convert_writes_a_native_checkpoint_that_reproduces_the_model(tmp_path, capsys):
    cfg = dict(vocab_size=41, d_state=16, d_emb=8, d_ffn=12, n_heads=2, d_key=4, d_val=3, n_layers=2)
    params = reference_gpn.random_params(cfg, True, np.random.default_rng(0))
    ckpt, config = reference_checkpoint.write(tmp_path / "run", params, cfg)
    assert cli(["convert", "--from-reference", str(ckpt), "--config", str(config), "--out", str(tmp_path / "native")]) == 0
    assert "gpn_m, 2 layer(s)" in capsys.readouterr().out
    native = load_native(tmp_path / "native")
    original = from_reference(ckpt, config)
    tokens = torch.randint(0, 41, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(native(tokens).token_losses, original(tokens).token_losses, rtol=0, atol=0)
    assert native.config == original.config


def test_native_roundtrip_keeps_execution_options(tmp_path):
    from gpn_scale.config import model_config
    from gpn_scale.models import build_model

    model = build_model(model_config("gpn_tiny", {"recompute_every": 4, "bptt": 16}))
    loaded = load_native(save_native(model, tmp_path))
    assert loaded.config == model.config
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n


def test_a_native_checkpoint_saved_before_recompute_every_was_named_so_loads(tmp_path):
    """A model.yaml written when recompute_every was checkpoint_every loads under the new name (a
    user's config with the old key is refused: test_train.py)."""
    from gpn_scale.config import model_config
    from gpn_scale.models import build_model
    from gpn_scale.storage.native import CONFIG

    model = build_model(model_config("gpn_tiny", {"recompute_every": 4}))
    out = save_native(model, tmp_path)
    saved = yaml.safe_load((out / CONFIG).read_text())
    (out / CONFIG).write_text(yaml.safe_dump({("checkpoint_every" if k == "recompute_every" else k): v
                                              for k, v in saved.items()}, sort_keys=False))
    add_manifest(out)
    assert "checkpoint_every: 4" in (out / CONFIG).read_text()
    assert load_native(out).config == model.config


def test_load_native_errors(tmp_path):
    with pytest.raises(UserError, match="missing model.safetensors"):
        load_native(tmp_path)
    from gpn_scale.config import model_config
    from gpn_scale.models import build_model

    save_native(build_model(model_config("gpn_tiny")), tmp_path)
    (tmp_path / "model.yaml").write_text((tmp_path / "model.yaml").read_text().replace("d_ffn: 128", "d_ffn: 64"))
    with pytest.raises(UserError, match=r"model.yaml has \d+ bytes, the manifest says \d+"):
        load_native(tmp_path)
    add_manifest(tmp_path)  # the edit recorded: now the weights do not fit the config
    with pytest.raises(UserError, match="weights do not match model.yaml"):
        load_native(tmp_path)
