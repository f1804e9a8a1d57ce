"""Gradients accumulated over calls (``forward_backward``) and one optimizer step on them
(``optim_step``), on 2 FSDP ranks: one call then a step is ``update_policy`` bitwise, two calls on
the same batch give twice its gradient, and a step with nothing accumulated is refused; with
``reduction="sum"`` two calls on halves give one call's gradient on the whole. On one rank in
this process: a step on a non-finite gradient norm is skipped (reported, the weights and the
optimizer's state left as they were)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from controller.clients import ActorClient
from deploy.session import local_session
from roles.base import RoleContext
from roles.engines.training.config import EngineConfig, OptimConfig
from roles.engines.training.fsdp import FSDPEngine
from roles.modeling.logprob import token_log_probs
from roles.modeling.models import init_model
from roles.runtime.device import HOST_DEVICE
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.roles.test_training import token_batch
from transport.batch import TensorBatch
from transport.errors import RemoteError
from transport.protocol import Layout
from transport.training import AdamStep

LOSS = {"clip_ratio_low": 0.2, "dual_clip": None}


def policy_batch(seed: int) -> TensorBatch:
    batch = token_batch(8, seed=seed)
    old = torch.zeros(batch.tensors["input_ids"].shape) - 2.0
    return batch.union(TensorBatch.from_dict({"old_log_probs": old}))


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
    engine = {"model": str(model), "dtype": "fp32", "micro_batch_size": 2, "optim": {"lr": 1e-2}}
    placement = [group("g", 2, a=("roles.actor:Actor", engine), b=("roles.actor:Actor", engine))]

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with local_session(placement, TEST_TIMEOUTS) as c:
            a, b = ActorClient(c, "a"), ActorClient(c, "b")
            first = policy_batch(1)
            out["whole"] = await a.update_policy(first, loss=LOSS)
            out["parts"] = await b.forward_backward(first, loss=LOSS)
            out["step"] = await b.optim_step()
            probe = token_batch(6, seed=9)
            out["a"] = (await a.compute_log_prob(probe))["log_probs"]
            out["b"] = (await b.compute_log_prob(probe))["log_probs"]
            second = policy_batch(2)  # a and b hold the same weights again: one call vs two
            await a.forward_backward(second, loss=LOSS)
            out["once"] = await a.optim_step()
            await b.forward_backward(second, loss=LOSS)
            await b.forward_backward(second, loss=LOSS)
            out["twice"] = await b.optim_step()
            try:
                await b.optim_step()
            except RemoteError as exc:
                out["refused"] = str(exc)
            # summed (Tinker's losses): two halves give the whole's gradient, not twice it
            await a.load_state(await b.state_dict())
            third = policy_batch(3)
            await a.forward_backward(third, LOSS, reduction="sum")
            out["sum_whole"] = await a.optim_step()
            for half in third.chunk(2):
                await b.forward_backward(half, LOSS, reduction="sum")
            out["sum_halves"] = await b.optim_step()
            # a call that fails on its second micro-batch on each rank (a token the model has
            # no embedding for) leaves none of its first micro-batch's gradients behind
            await a.load_state(await b.state_dict())
            fourth = policy_batch(4)
            await a.forward_backward(fourth, LOSS)
            out["clean"] = await a.optim_step()
            broken = policy_batch(5)
            broken.tensors["input_ids"][[3, 7], 1] = 10**6  # rows 2-3 and 6-7: second micro-batches
            try:
                await b.forward_backward(broken, LOSS)
            except RemoteError as exc:
                out["broken"] = str(exc)
            await b.forward_backward(fourth, LOSS)
            out["after_broken"] = await b.optim_step()
            # the log-probs a loss saw, kept from its own forward on 2 dp ranks of 3 rows each
            # (two micro-batches, one short), against a forward of their own on the same weights
            await a.load_state(await b.state_dict())
            fifth = policy_batch(6)[:6]
            out["seen"] = (await a.compute_log_prob(fifth))["log_probs"] * fifth["response_mask"]
            out["plain"] = await b.forward_backward(fifth, LOSS, reduction="sum")
            out["kept"] = await a.forward_backward_kept(fifth, LOSS, reduction="sum")
            await a.discard_gradients()
            await b.discard_gradients()
        return out

    result: dict[str, Any] = run(main)
    return result


def test_one_call_then_a_step_is_update_policy_bitwise(found: dict[str, Any]) -> None:
    assert found["step"]["grad_norm"] == found["whole"]["grad_norm"]
    assert found["parts"]["loss"] == found["whole"]["loss"]
    assert torch.equal(found["a"], found["b"])


def test_two_calls_add_their_gradients(found: dict[str, Any]) -> None:
    assert found["twice"]["grad_norm"] == pytest.approx(2 * found["once"]["grad_norm"], rel=1e-5)


def test_a_step_without_gradients_is_refused(found: dict[str, Any]) -> None:
    assert "no gradients since the last step; call forward_backward" in found["refused"]


def test_summed_calls_on_halves_give_the_gradient_of_one_call_on_the_whole(
    found: dict[str, Any],
) -> None:
    """``reduction="sum"``: no call normalises by its own batch, so parts add up to the whole
    (the norm is taken before clipping, on the same weights)."""
    whole, halves = found["sum_whole"]["grad_norm"], found["sum_halves"]["grad_norm"]
    assert halves == pytest.approx(whole, rel=1e-5)
    assert whole > found["once"]["grad_norm"]  # a sum over 8 rows' tokens, not their mean


def test_a_failed_call_leaves_no_gradients_behind(found: dict[str, Any]) -> None:
    """Its first micro-batch's gradients were left with no call counted, and the next step took
    them with its own (a larger norm)."""
    assert "index out of range" in found["broken"]
    assert found["after_broken"]["grad_norm"] == found["clean"]["grad_norm"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


def one_rank(model: Path) -> FSDPEngine:
    """The actor's engine on one rank in this process (micro-batches of 2 rows)."""
    cfg = EngineConfig(model=str(model), dtype="fp32", micro_batch_size=2, optim=OptimConfig())
    return FSDPEngine(cfg, RoleContext("actor", "g", 0, 1, Layout(), None, HOST_DEVICE))


def nll(
    logits: torch.Tensor, micro: TensorBatch, tokens: float, _: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The token-mean next-token loss of the response tokens."""
    logp = token_log_probs(logits, micro.tensor("input_ids")) * micro.tensor("response_mask")
    return -logp.sum() / tokens, {}


def weights(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def test_a_step_on_a_non_finite_gradient_is_skipped_and_reported(tiny: Path) -> None:
    """A NaN gradient (a loss on NaN log-probs) must not reach the weights: clipping cannot
    scale it, so the step is skipped, counted as a step and reported; the optimizer's moments
    and the schedule do not move, so the next step is the one an engine that never saw the NaN
    takes."""
    torch.manual_seed(0)
    engine, clean = one_rank(tiny), one_rank(tiny)
    batch = token_batch(4, seed=1)

    def poisoned(*args: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = nll(*args)
        return loss * float("nan"), metrics

    before = weights(engine)
    engine.forward_backward(batch, poisoned)
    found = engine.optim_step()
    assert found["skipped"] == 1.0 and math.isnan(found["grad_norm"]), found
    assert all(torch.equal(before[k], v) for k, v in weights(engine).items())
    assert (engine.step, engine.accumulated) == (1, 0)  # counted; its gradients are gone
    engine.forward_backward(batch, nll)
    clean.forward_backward(batch, nll)
    stepped, expected = engine.optim_step(), clean.optim_step()
    assert stepped == expected and stepped["skipped"] == 0.0
    after = weights(engine)
    assert all(torch.equal(after[k], v) for k, v in weights(clean).items())
    assert any(not torch.equal(before[k], v) for k, v in after.items())


def test_a_call_that_fails_midway_drops_its_gradients_and_says_so(tiny: Path) -> None:
    """A ``forward_backward`` or ``train_step`` that raises on its second micro-batch: the first
    one's gradients must not reach the next step (they did, uncounted). Gradients of earlier
    calls cannot be told apart from them: they are dropped too, and the error says so."""
    torch.manual_seed(0)
    engine, clean = one_rank(tiny), one_rank(tiny)
    batch = token_batch(4, seed=1)
    calls = 0

    def fails_second(*args: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        nonlocal calls
        calls += 1
        if calls % 2 == 0:
            raise RuntimeError("the second micro-batch's loss failed")
        return nll(*args)

    with pytest.raises(RuntimeError, match="second micro-batch"):
        engine.train_step(batch, fails_second)
    assert engine.accumulated == 0
    assert all(p.grad is None for p in engine.module.parameters())
    engine.forward_backward(batch, nll)
    with pytest.raises(RuntimeError, match="second micro-batch") as failed:
        engine.forward_backward(batch, fails_second)
    assert "1 forward_backward call(s) before it were dropped too" in str(failed.value.__notes__)
    assert engine.accumulated == 0
    assert all(p.grad is None for p in engine.module.parameters())
    stepped = engine.train_step(batch, nll)
    assert stepped == clean.train_step(batch, nll)


def test_a_step_with_its_own_adam_settings_is_adamw_with_them(tiny: Path) -> None:
    """Tinker sends AdamW's settings with every step (``AdamStep``): the step is torch's AdamW
    with those settings on the same gradients, the moments carried on from the step before
    (whose settings differed), clipped only when the step says so."""
    torch.manual_seed(0)
    engine = one_rank(tiny)
    mine = {
        n: p.detach().clone().requires_grad_(p.requires_grad)
        for n, p in engine.module.named_parameters()
    }
    trained = [p for p in mine.values() if p.requires_grad]
    steps = [
        AdamStep(lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1),
        AdamStep(lr=5e-3, betas=(0.85, 0.95), eps=1e-8, weight_decay=0.0, grad_clip=0.05),
    ]
    adamw = torch.optim.AdamW(trained, lr=1.0, fused=True)
    for i, adam in enumerate(steps):
        engine.forward_backward(token_batch(4, seed=i), nll)
        grads = {
            n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None
        }
        found = engine.optim_step(adam)
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        assert found["grad_norm"] == pytest.approx(norm, rel=1e-6)
        scale = min(1.0, adam.grad_clip / (norm + 1e-6)) if adam.grad_clip else 1.0
        for name, p in mine.items():
            if p.requires_grad:
                p.grad = grads[name] * scale
        for settings in adamw.param_groups:
            settings.update(
                lr=adam.lr, betas=adam.betas, eps=adam.eps, weight_decay=adam.weight_decay
            )
        adamw.step()
        assert found["lr"] == adam.lr
        for name, p in engine.module.named_parameters():
            torch.testing.assert_close(p.detach(), mine[name].detach(), rtol=0, atol=1e-7)


def test_a_kept_call_returns_the_log_probs_its_loss_saw(found: dict[str, Any]) -> None:
    """``forward_backward_kept`` (Tinker's ``forward_backward`` returns these): its log-probs,
    gathered from the dp ranks in row order, are a plain forward's on the same weights, its
    metrics the plain call's."""
    kept = found["kept"]
    torch.testing.assert_close(kept["log_probs"], found["seen"], rtol=0, atol=1e-6)
    assert kept.meta["metrics"]["loss"] == pytest.approx(found["plain"]["loss"], rel=1e-6)
