"""The training primitives on ``Datum`` rows, on a real mesh (the quickstart's actor on 2 ranks):
the cross-entropy and importance-sampling losses accumulate through ``forward_backward`` with the
values computed here by hand from the same rows' log-probs, and a batch that lacks a loss's
column is refused before any call."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

import hybridflow as hf
from transport.batch import BatchError

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


def as_rows(batch: hf.TensorBatch) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) token ids of each sampled row."""
    found = []
    columns = [batch.tensors[c] for c in ("input_ids", "attention_mask", "response_mask")]
    for ids, attention, response in zip(*columns, strict=True):
        real = ids[attention.bool()].tolist()
        start = int(response.nonzero()[0])
        found.append((real[:start], real[start : start + int(response.sum())]))
    return found


async def primitives(run_dir: Path) -> None:
    async with hf.mesh(QUICKSTART, "logging.tensorboard=false", run_dir=run_dir) as m:
        await m.configure_optim(hf.OptimConfig(lr=1e-3))
        sampled = await m.sample(["12+7=", "30+4="], hf.SamplingConfig(n=2, max_new_tokens=4))
        # the prompt each row answers, over the whole call (each of the 2 ranks numbers its own)
        assert sampled.non_tensors["request"] == [0, 0, 1, 1]
        tokens = as_rows(sampled)
        plain = [hf.Datum(p, r) for p, r in tokens]
        logp = await m.log_probs(plain)
        mask = hf.batch_of(plain).tensors["response_mask"].float()
        per_row = [logp[i][mask[i].bool()].tolist() for i in range(len(tokens))]

        # cross-entropy, the first row weighted 0: sum(w x nll) over all marked tokens
        weights = [0.0, 1.0, 1.0, 1.0]
        ce_rows = [hf.Datum(p, r, weights=w) for (p, r), w in zip(tokens, weights, strict=True)]
        ce = await m.forward_backward(ce_rows, "cross_entropy")
        nll = -(logp * mask).sum(-1)
        expected = float((torch.tensor(weights) * nll).sum() / mask.sum())
        assert ce["loss"] == pytest.approx(expected, rel=1e-4)

        # importance sampling at pi = pi_old: the ratio is 1, the loss -sum(A) / tokens
        advantages = [1.0, -1.0, 0.5, 2.0]
        is_rows = [
            hf.Datum(p, r, advantages=a, old_log_probs=old)
            for (p, r), a, old in zip(tokens, advantages, per_row, strict=True)
        ]
        loss = hf.PolicyLossConfig(kind="importance_sampling")
        found = await m.forward_backward(is_rows, loss)
        expected = -float((torch.tensor(advantages) * mask.sum(-1)).sum() / mask.sum())
        assert found["pg_loss"] == pytest.approx(expected, abs=1e-3)

        with pytest.raises(BatchError, match="advantages"):  # refused here, no call made
            await m.forward_backward(plain, loss)
        assert m.version == 0
        stepped = await m.optim_step()  # both calls' gradients, one step
        assert m.version == 1 and stepped["grad_norm"] > 0
        after = await m.log_probs(plain)
        assert not torch.equal(after, logp)


@pytest.mark.timeout(180)
def test_datum_rows_through_both_losses_on_a_real_mesh(tmp_path: Path) -> None:
    asyncio.run(primitives(tmp_path / "run"))


async def lora_primitives(run_dir: Path) -> None:
    lora = "roles.actor.lora={rank: 8, alpha: 16}"
    async with hf.mesh(QUICKSTART, lora, "logging.tensorboard=false", run_dir=run_dir) as m:
        await m.configure_optim(hf.OptimConfig(lr=1e-2))
        sampled = await m.sample(["12+7=", "30+4="], hf.SamplingConfig(n=2, max_new_tokens=4))
        rows = [hf.Datum(p, r) for p, r in as_rows(sampled)]
        base = await m.log_probs(rows, role="reference")  # the actor, adapters off
        assert torch.equal(await m.log_probs(rows), base)  # B = 0: the adapters add nothing yet
        await m.forward_backward(rows, "cross_entropy")
        await m.optim_step()
        assert not torch.equal(await m.log_probs(rows), base)  # the adapters learnt
        assert torch.equal(await m.log_probs(rows, role="reference"), base)  # the base did not
        merged = await m.export(run_dir / "export")
        assert (merged / "model.safetensors").is_file()
        assert (run_dir / "export-adapter" / "adapter_config.json").is_file()


@pytest.mark.timeout(180)
def test_a_lora_actor_trains_its_adapters_through_the_same_primitives(tmp_path: Path) -> None:
    asyncio.run(lora_primitives(tmp_path / "run"))


def test_multi_turn_request_seeds_do_not_replay_a_neighbouring_calls() -> None:
    """With ``seed=step``, ``seed + i`` seeded request i of step s + 1 as request i + 1 of step
    s (the same turns drawn again); a hash of (seed, request) shares none."""
    from deploy.mesh import request_seeds

    for seed in range(4):
        assert not set(request_seeds(seed, 8)) & set(request_seeds(seed + 1, 8))
    assert request_seeds(3, 8) == request_seeds(3, 8)
    assert len(set(request_seeds(0, 64))) == 64


def test_a_critics_fresh_optimizer_keeps_the_actors_accumulated_calls(tmp_path: Path) -> None:
    """``configure_optim(role="critic")`` snapshots every training role, but the actor's
    gradients are not in a snapshot and stay pending: the calls that made them must stay on the
    replay list (they were cleared, so a rollback then lost them). The roles are fakes: what is
    under test is the mesh's bookkeeping."""
    from types import SimpleNamespace

    from deploy.mesh import Accumulated, Mesh, Recovery

    class Engine:
        async def configure_optim(self, optim: hf.OptimConfig) -> int:
            return 0

        async def snapshot(self, folder: str, label: int) -> int:
            return 0

    roles = SimpleNamespace(engines=lambda: {"actor": Engine(), "critic": Engine()})
    m = Mesh(None, None, tmp_path, roles, None, recovery=Recovery(tmp_path))  # type: ignore[arg-type]
    m.accumulated.append(
        Accumulated(hf.batch_of([hf.Datum([1], [2])]), "cross_entropy", 1.0, "mean")
    )
    asyncio.run(m.configure_optim(hf.OptimConfig(), role="critic"))
    assert len(m.accumulated) == 1 and m.recovery is not None and m.recovery.label == 1
    asyncio.run(m.configure_optim(hf.OptimConfig(), role="actor"))  # its gradients go with it
    assert m.accumulated == []


def test_a_cancelled_configure_optim_or_rebase_is_completed_before_the_next_call(
    tmp_path: Path,
) -> None:
    """Cancelled once its first call left, a state call may or may not have run on the ranks,
    and the mesh's record of it (the optimizer a rollback gives back, the snapshot) was never
    made: it runs again in full before the next call (each is idempotent). The roles are fakes
    whose call hangs when told to, so the cancel lands while the ranks hold the call."""
    from types import SimpleNamespace

    from deploy.mesh import Mesh, Recovery

    class Engine:
        def __init__(self) -> None:
            self.calls: list[str] = []
            self.arrived: asyncio.Event | None = None  # set: the next call hangs

        async def hold(self, what: str) -> None:
            self.calls.append(what)
            arrived, self.arrived = self.arrived, None
            if arrived is not None:
                arrived.set()
                await asyncio.Event().wait()  # until cancelled

        async def configure_optim(self, optim: hf.OptimConfig) -> None:
            await self.hold(f"optim {optim.lr}")

        async def snapshot(self, folder: str, label: int) -> int:
            return 0

    async def cancel(engine: Engine, call: Any) -> None:
        engine.arrived = arrived = asyncio.Event()
        task = asyncio.ensure_future(call)
        await arrived.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def main() -> None:
        actor, critic = Engine(), Engine()
        roles = SimpleNamespace(engines=lambda: {"actor": actor, "critic": critic}, reference=None)
        pushed = SimpleNamespace(push=lambda client, version, strict: critic.hold("push"))
        pipeline = SimpleNamespace(weights=pushed, version=3)
        rec = Recovery(tmp_path)
        m = Mesh(None, None, tmp_path, roles, pipeline, recovery=rec)  # type: ignore[arg-type]
        await cancel(actor, m.configure_optim(hf.OptimConfig(lr=0.5)))
        assert rec.optims == {} and rec.label == 0
        await m.configure_optim(hf.OptimConfig(lr=0.25), role="critic")  # completes it first
        assert actor.calls == ["optim 0.5", "optim 0.5"] and critic.calls == ["optim 0.25"]
        assert rec.optims["actor"].lr == 0.5 and rec.label == 2

        critic.calls.clear()
        await cancel(critic, m.rebase("critic"))
        assert rec.label == 2
        await m.configure_optim(hf.OptimConfig(lr=0.125), role="critic")
        assert critic.calls == ["push", "push", "optim 0.125"] and rec.label == 4

    asyncio.run(main())
