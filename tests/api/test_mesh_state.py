"""What the mesh's training primitives must keep true on a real mesh (the quickstart's tiny actor
with the reward on one rank, a rollout group of one rank): sampled log-probs are the trainer's at
the sampling temperature (at 1 for a greedy sample), a cancelled or failed call is settled
before the next one (a step that ran is counted and pushed; gradients it added are taken back;
a cancelled ``load_state`` is completed), and ``load_state`` leaves neither another branch's
weights on the rollout group nor gradients of the replaced weights."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

import hybridflow as hf

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
GROUPS = [
    "roles.rollout={model: base}",
    "roles.reference={model: base}",
    "placement.main={roles: [actor, reference], nproc: 2}",
    "placement.gen={roles: [rollout], nproc: 1}",
    "placement.score={roles: [reward], nproc: 3}",
    "logging.tensorboard=false",
]
PROMPTS = ["12+7=", "30+4=", "5+5="]
ROWS_A = [hf.Datum([1, 40, 41], [42, 43]), hf.Datum([1, 50], [51, 52, 53])]
ROWS_B = [hf.Datum([1, 60, 61], [62]), hf.Datum([1, 70], [71, 72])]


def sampled_against_trainer(batch: hf.TensorBatch, trained: torch.Tensor) -> float:
    """The largest gap between the generator's log-probs and the trainer's on sampled tokens."""
    mask = batch.tensors["response_mask"].bool()
    return float((batch.tensors["log_probs"][mask] - trained[mask]).abs().max())


async def cancelled(m: hf.Mesh, call: Any, method: str) -> None:
    """Run ``call`` and cancel it the moment its ``method`` call has left for the ranks (as a
    Ctrl-C that lands while the ranks compute): it raises CancelledError here."""
    send = m.controller._send
    task: asyncio.Future[Any]

    def spy(*args: Any) -> None:
        send(*args)
        if args[2].body.get("method") == method:
            task.cancel()

    m.controller._send = spy  # type: ignore[method-assign]
    try:
        task = asyncio.ensure_future(call)
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        m.controller._send = send  # type: ignore[method-assign]


async def scenario(run_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with hf.mesh(QUICKSTART, *GROUPS, run_dir=run_dir) as m:
        await m.configure_optim(hf.OptimConfig(lr=5e-2, warmup_steps=0))

        # fewer rows than ranks, and one more: the actor on 2, the reward on 3
        for n in (1, 2, 4):
            rows = [{"prompt": "12+7=", "answer": "19"}] * n
            few = await m.sample(rows, hf.SamplingConfig(n=1, max_new_tokens=4))
            score, _ = await m.score(few)
            logp = await m.log_probs(few)
            out[f"rows_{n}"] = (len(few), len(score), logp.shape[0])

        # sampled at T = 0.7, the sampler's log-probs as old_log_probs: the first ratio is 1
        warm = hf.SamplingConfig(n=2, max_new_tokens=4, temperature=0.7, seed=1)
        batch = await m.sample(PROMPTS, warm)
        out["gap_at_t"] = sampled_against_trainer(batch, await m.log_probs(batch))
        # the same batch as Datum rows, and the actor's tokenizer in this process
        rows = hf.datums(batch, old_log_probs=batch.tensors["log_probs"])
        out["first_prompt"] = m.tokenizer.decode(rows[0].prompt, skip_special_tokens=True)
        # ... whose log-probs are at the temperature the batch was sampled at, as its own
        by_rows = await m.log_probs(rows)
        on_rows = hf.batch_of(rows).tensors["response_mask"].bool()
        old = [x for r in rows for x in (r.old_log_probs or [])]
        out["gap_rows"] = float((by_rows[on_rows] - torch.tensor(old)).abs().max())
        batch.tensors["old_log_probs"] = batch.tensors["log_probs"]
        batch.tensors["advantages"] = batch.tensors["response_mask"].float()
        out["first"] = await m.forward_backward(batch, hf.PolicyLossConfig())
        # greedy (T = 0): the generator reports log-probs at T = 1, and so must the trainer
        greedy = await m.sample(PROMPTS, hf.SamplingConfig(n=1, max_new_tokens=4, temperature=0))
        out["gap_greedy"] = sampled_against_trainer(greedy, await m.log_probs(greedy))

        # a forward_backward that fails on the ranks (a token the model has no embedding for)
        # drops every pending gradient there: the calls before it are replayed
        bad = [hf.Datum([1, 10**6], [42]), hf.Datum([1, 10**6], [43])]
        with pytest.raises(hf.RemoteError, match="index out of range"):
            await m.forward_backward(bad, "cross_entropy")
        await m.sync_weights()  # any call settles it first
        out["after_failure"] = (await m.actor.progress())["accumulated"]

        # a forward_backward cancelled after it left: its gradients are taken back
        await cancelled(m, m.forward_backward(ROWS_A, "cross_entropy"), "forward_backward_nll")
        out["ran_anyway"] = (await m.actor.progress())["accumulated"]
        await m.sync_weights()  # any call settles it first
        out["after_cancel"] = (await m.actor.progress())["accumulated"]

        # an optim_step cancelled after it left: it ran, so it is counted and pushed
        await cancelled(m, m.optim_step(), "optim_step")
        out["version_after_cancelled_step"] = await m.sync_weights()
        out["engine_step"] = (await m.actor.progress())["step"]

        # a whole step with gradients pending is refused (they were silently dropped); one
        # row on the 2 ranks: the idle rank's copy of it counts no token
        one = await m.forward_backward(ROWS_A[:1], "cross_entropy")
        out["one_row_tokens"] = one["tokens"]
        rows = [
            hf.Datum(d.prompt, d.response, advantages=1.0, old_log_probs=[-1.0] * len(d.response))
            for d in ROWS_A
        ]
        with pytest.raises(hf.RemoteEngineError, match=r"forward_backward call.* are pending"):
            await m.train_step(rows, hf.PolicyLossConfig())
        await m.optim_step()

        # two branches from one saved state; the second must be what the rollout group samples
        await m.save_state("a")
        for _ in range(3):
            await m.forward_backward(ROWS_A, "cross_entropy")
            await m.optim_step()
        await m.sample(PROMPTS, hf.SamplingConfig(n=1, max_new_tokens=4))  # pushes branch 1
        await m.forward_backward(ROWS_A, "cross_entropy")  # pending when the state is loaded
        # cancelled once the actor's load left (the reference's never did): completed before
        # the next call, or the version, the pending gradients and the rollout group's weights
        # stay those of branch 1
        await cancelled(m, m.load_state("a"), "load")
        out["loaded_version"] = await m.sync_weights()
        with pytest.raises(hf.RemoteEngineError, match="no gradients since the last step"):
            await m.optim_step()
        for _ in range(3):
            await m.forward_backward(ROWS_B, "cross_entropy")
            await m.optim_step()
        batch = await m.sample(PROMPTS, hf.SamplingConfig(n=1, max_new_tokens=4, seed=3))
        out["branch_version"] = batch.meta["weight_version"]
        actor = await m.log_probs(batch)
        out["gap_after_load"] = sampled_against_trainer(batch, actor)

        # the reference becomes the trained actor (it was the initial weights)
        before = await m.log_probs(batch, role="reference")
        await m.rebase("reference")
        after = await m.log_probs(batch, role="reference")
        out["reference"] = [float((x - actor).abs().max()) for x in (before, after)]
        with pytest.raises(ValueError, match="no model role 'critic'"):
            await m.rebase("critic")
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_temperature_cancels_and_branches_keep_the_mesh_true(tmp_path: Path) -> None:
    out = asyncio.run(scenario(tmp_path))
    # the trainer's log-probs at the sampling temperature are the sampler's (fp32)
    assert out["gap_at_t"] < 1e-3, out
    assert out["gap_greedy"] < 1e-3, out  # a NaN compares False
    assert out["gap_rows"] < 1e-3, out  # Datum rows of the batch: at its temperature too
    assert out["first_prompt"] == PROMPTS[0]
    assert [out[f"rows_{n}"] for n in (1, 2, 4)] == [(1, 1, 1), (2, 2, 2), (4, 4, 4)]
    assert out["one_row_tokens"] == 2  # the row's own 2 response tokens; the idle copy none
    assert abs(out["first"]["ppo_kl"]) < 1e-4 and out["first"]["pg_clipfrac"] == 0.0, out
    # a failed forward_backward dropped the pending gradients: the call before it replayed
    assert out["after_failure"] == 1, out
    # the cancelled forward_backward ran on the ranks; settled, its gradients are gone
    assert out["ran_anyway"] == 2 and out["after_cancel"] == 1, out
    # the cancelled optim_step ran: the mesh counts it and the rollout group serves it
    assert out["version_after_cancelled_step"] == 1 and out["engine_step"] == 1, out
    # load_state: the saved version, no stale gradients, and branch 2 is what is sampled
    assert out["loaded_version"] == 2 and out["branch_version"] == 5, out
    assert out["gap_after_load"] < 1e-3, out
    assert out["reference"][0] > 0.1 and out["reference"][1] < 1e-4, out
