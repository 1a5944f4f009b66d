"""Helpers shared by the tests that hold a kernel to its reference twin (Triton and C++ alike)."""

import dataclasses

import torch


def assert_close(got, want, tol, name):
    """Max abs error relative to want's max abs at most `tol`; NaN anywhere fails."""
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()
    assert err <= tol, f"{name}: relative error {err} > {tol}"  # NaN <= tol is False


def memory_inputs(B, H, dk, dv, dtype, seed=0, device="cpu"):
    """Memory-step inputs: M in the state's dtype (float64 for float64, else float32) and the
    vectors in `dtype`; k and q relu'd and l2-normalised, v and gate as column slices of one wider
    row, as the fused core's projection output holds them."""
    g = torch.Generator().manual_seed(seed)
    state = torch.float64 if dtype == torch.float64 else torch.float32
    r = lambda *s: torch.randn(*s, generator=g, dtype=state).to(device)  # noqa: E731
    unit = lambda x: torch.relu(x) / torch.relu(x).norm(dim=-1, keepdim=True).clamp_min(1e-6)  # noqa: E731
    row = r(B, 2 * H * dv + 5)
    return dict(M=r(B, H, dk, dv), k=unit(r(B, H, dk)).to(dtype), v=row[:, 2 : 2 + H * dv].to(dtype).view(B, H, dv),
                beta=torch.sigmoid(r(B, H)), decay=torch.exp(-r(B, H).abs()), q=unit(r(B, H, dk)).to(dtype),
                gate=row[:, 3 + H * dv : 3 + 2 * H * dv].to(dtype))


def count_calls(monkeypatch, module, names, calls: list) -> None:
    """Every call of `module.OPS`'s functions `names` (an implementation's kernels) appends its
    name to `calls`. A model resolves its kernels at its first forward, after this."""
    wrapped = {n: (lambda *a, _fn=getattr(module.OPS, n), _name=n, **kw: calls.append(_name) or _fn(*a, **kw)) for n in names}
    monkeypatch.setattr(module, "OPS", dataclasses.replace(module.OPS, **wrapped))
