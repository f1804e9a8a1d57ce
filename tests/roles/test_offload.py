"""Optimizer state offloaded while generating: its storage is freed inside the block and comes
back bitwise, so the next optimizer step equals one that never offloaded."""

from __future__ import annotations

import copy

import torch

from roles.engines.hybrid import optimizer_offloaded


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, optim)
    return model, optim


def step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.ones(3, 8)).square().sum().backward()
    optim.step()


def test_offloaded_state_is_freed_then_restored_bitwise() -> None:
    model, optim = trained(0)
    twin_model, twin_optim = copy.deepcopy(model), None
    twin_optim = torch.optim.AdamW(twin_model.parameters(), lr=1e-2)
    twin_optim.load_state_dict(copy.deepcopy(optim.state_dict()))
    moments = [s["exp_avg"] for s in optim.state.values()]
    expected = sum(2 * p.numel() * 4 for p in model.parameters())  # exp_avg + exp_avg_sq, fp32
    with optimizer_offloaded(optim) as moved:
        assert moved == expected
        assert all(m.untyped_storage().nbytes() == 0 for m in moments)  # freed
    assert all(m.untyped_storage().nbytes() == m.numel() * 4 for m in moments)
    for a, b in zip(optim.state.values(), twin_optim.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    step(model, optim)
    step(twin_model, twin_optim)
    for p, q in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_nothing_to_offload_moves_nothing() -> None:
    with optimizer_offloaded(None) as moved:
        assert moved == 0
