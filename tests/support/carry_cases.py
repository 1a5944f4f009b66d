"""The carried-state tests' models (tests/train/test_carry.py, tests/models/test_resets.py): GPN+M cases
in both memory forms and a Gated DeltaNet, in float64, every path live."""

import torch

from gpn_scale.models import GPN, GatedDeltaNet, GDNConfig, GPNConfig

CASES = {
    "gpn_1l": dict(family="gpn", n_layers=1),
    "gpn_m_1l_step": dict(n_layers=1, memory_form="step"),
    "gpn_m_1l_chunk": dict(n_layers=1, memory_form="chunk", core_chunk=3),
    "gpn_m_2l_chunk": dict(n_layers=2, memory_form="chunk", core_chunk=4, use_decoder_bias=True),
}
GDN = GDNConfig(vocab_size=53, d_model=24, n_layers=2, n_heads=2, d_key=6, d_val=8, d_ffn=40, chunk_size=4)


def make(cfg, seed=0):
    torch.manual_seed(seed)
    model = (GPN if isinstance(cfg, GPNConfig) else GatedDeltaNet)(cfg).double()
    with torch.no_grad():  # move the zero-initialised gates and out-projections: every path live
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model
