"""In-memory snapshots (``roles/engines/training/snapshot.py``): a restore replays training exactly.

One session runs two fsdp groups of 2 gloo ranks (dp = 2, sharded): group ``a`` hosts the actor
that takes snapshots and an untouched twin; group ``b`` hosts a second actor, fresh, standing for
a restarted group — new processes that restore the first actor's snapshots from its folder. The
scenario runs once (a module fixture) and the tests below read what it recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deploy.session import local_session
from roles.engines.training.interface import TrainingEngine
from roles.engines.training.megatron.engine import MegatronEngine
from roles.engines.training.snapshot import MANIFEST, RankSnapshots
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.clients import ProbedActorClient
from tests.roles.test_training import POLICY_LOSS, token_batch
from transport.batch import TensorBatch
from transport.errors import RemoteError
from transport.protocol import PEAK_MEMORY

Record = dict[str, Any]


def placement(model: Path) -> list[Any]:
    config = {"model": str(model), "dtype": "fp32", "micro_batch_size": 2, "optim": {"lr": 1e-3}}
    actor = ("tests.fixtures.actor:ProbedActor", config)
    return [group("a", 2, actor=actor, untouched=actor), group("b", 2, restarted=actor)]


def batch_of(step: int, logp: torch.Tensor) -> TensorBatch:
    """The batch of optimizer step ``step`` (its own advantages), around fixed old log-probs."""
    batch = token_batch(6, seed=100 + step)
    extra = {"old_log_probs": logp, "ref_log_probs": logp - 0.05}
    return batch.union(TensorBatch.from_dict(extra))


async def train(actor: ProbedActorClient, steps: range, logp: torch.Tensor) -> Record:
    """Optimizer steps ``steps``: each one's metrics, then the weights and a draw of the RNG."""
    metrics = []
    for step in steps:
        found = await actor.update_policy(batch_of(step, logp), loss=POLICY_LOSS)
        metrics.append({k: v for k, v in found.items() if k != PEAK_MEMORY})
    return {"metrics": metrics, "weights": await actor.state_dict(), "draw": await actor.draw()}


async def scenario(c: Any, folder: str) -> dict[str, Any]:
    actor, untouched = ProbedActorClient(c, "actor"), ProbedActorClient(c, "untouched")
    restarted = ProbedActorClient(c, "restarted")
    logp = (await actor.compute_log_prob(token_batch(6, seed=1)))["log_probs"]
    out: dict[str, Any] = {"bytes": await actor.snapshot(folder, 0)}  # before the first step
    out["after_fresh"] = await train(actor, range(1, 3), logp)
    out["untouched"] = await train(untouched, range(1, 3), logp)
    await actor.snapshot(folder, 2)
    out["original"] = await train(actor, range(3, 5), logp)
    await actor.snapshot(folder, 4)  # into the slot of step 0
    # a fresh engine in other processes, as a restarted group: step 2, then the same steps
    out["restored_at"] = await restarted.restore_snapshot(folder, 2)
    out["restarted"] = await train(restarted, range(3, 5), logp)
    out["restarted_4"] = await restarted.restore_snapshot(folder, 4)
    out["restarted_4_weights"] = await restarted.state_dict()
    out["restarted_5"] = await train(restarted, range(5, 6), logp)
    # the same engine, back to step 2 and then to step 4 (both slots)
    assert await actor.restore_snapshot(folder, 2) == 2
    out["replayed"] = await train(actor, range(3, 5), logp)
    assert await actor.restore_snapshot(folder, 4) == 4
    out["actor_5"] = await train(actor, range(5, 6), logp)
    # a snapshot cut short: step 6 goes into the slot not holding step 4 (the newest, restored
    # last) and its manifest goes, as if every rank had died mid-copy
    await actor.snapshot(folder, 6)
    cut = [m for m in Path(folder).glob(f"rank*/slot*/{MANIFEST}") if '"step": 6' in m.read_text()]
    assert len(cut) == 2  # one per rank
    for manifest in cut:
        manifest.unlink()
    with pytest.raises(
        RemoteError, match=r"FileNotFoundError.*step 6 for rank \d in .*steps \[4\]"
    ):
        await restarted.restore_snapshot(folder, 6)
    await actor.snapshot(folder, 7)  # into the slot cut short, not over step 4
    out["after_cut"] = await restarted.restore_snapshot(folder, 4)
    out["after_cut_weights"] = await restarted.state_dict()
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
    folder = tmp_path_factory.mktemp("snapshots") / "actor"  # the controller puts it on /dev/shm

    async def main() -> dict[str, Any]:
        async with local_session(placement(model), TEST_TIMEOUTS) as c:
            return await scenario(c, str(folder))

    found: dict[str, Any] = run(main)
    return found


def same(a: Record, b: Record) -> None:
    """Bitwise: the same metrics, weights and random draws."""
    assert a["metrics"] == b["metrics"]
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert a["draw"] == b["draw"]


def test_a_snapshot_before_the_first_step_does_not_change_training(
    recorded: dict[str, Any],
) -> None:
    assert recorded["bytes"] > 0
    fresh, untouched = recorded["after_fresh"], recorded["untouched"]
    assert fresh["metrics"] == untouched["metrics"]
    assert all(torch.equal(fresh["weights"][k], v) for k, v in untouched["weights"].items())


def test_a_restarted_engine_restores_and_replays_exactly(recorded: dict[str, Any]) -> None:
    assert recorded["restored_at"] == 2
    same(recorded["restarted"], recorded["original"])
    assert recorded["original"]["metrics"][0]["loss"] != recorded["original"]["metrics"][1]["loss"]


def test_the_same_engine_restores_either_slot(recorded: dict[str, Any]) -> None:
    same(recorded["replayed"], recorded["original"])
    assert recorded["restarted_4"] == 4
    weights = recorded["original"]["weights"]
    assert all(torch.equal(recorded["restarted_4_weights"][k], v) for k, v in weights.items())
    same(recorded["restarted_5"], recorded["actor_5"])


def test_a_slot_cut_short_is_never_read_nor_the_other_overwritten(
    recorded: dict[str, Any],
) -> None:
    assert recorded["after_cut"] == 4
    weights = recorded["actor_5"]["weights"]
    assert any(not torch.equal(recorded["after_cut_weights"][k], v) for k, v in weights.items())
    weights = recorded["original"]["weights"]  # those of step 4
    assert all(torch.equal(recorded["after_cut_weights"][k], v) for k, v in weights.items())


# -- the files, in process ----------------------------------------------------------------------


def state_of(seed: int) -> dict[str, Any]:
    """An engine-like state: fp32, bf16, non-contiguous, scalar and empty tensors, small leaves."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(4, 6, generator=gen), "t": torch.randn(6, 4, generator=gen).T},
        "optim": {
            "state": {"w": {"step": torch.tensor(float(seed)), "m": torch.randn(3, generator=gen)}},
            "bf16": torch.randn(5, generator=gen).bfloat16(),
            "empty": torch.zeros(0, 3),
            "param_groups": [{"lr": 0.1 * seed, "betas": (0.9, 0.99), "params": ["w"]}],
        },
    }


def test_slots_alternate_hold_every_kind_of_tensor_and_refuse_what_does_not_fit(
    tmp_path: Path,
) -> None:
    engine = {"dp": 1}
    store = RankSnapshots(tmp_path, 0)
    for step in (1, 2, 3):
        store.write(step, state_of(step), {"rng": torch.arange(3)}, engine)
    again = RankSnapshots(tmp_path, 0)  # another process: maps the files anew
    with pytest.raises(FileNotFoundError, match=r"step 1 for rank 0 .*steps \[2, 3\]"):
        again.read(1, engine)
    tensors, extras = again.read(2, engine)
    want = state_of(2)
    assert torch.equal(tensors["model.t"], want["model"]["t"])  # non-contiguous, by value
    assert torch.equal(tensors["optim.bf16"], want["optim"]["bf16"])
    assert tensors["optim.state.w.step"].shape == () and float(tensors["optim.state.w.step"]) == 2
    assert extras["leaves"]["optim.param_groups"] == want["optim"]["param_groups"]
    assert extras["leaves"]["optim.empty"].shape == (0, 3)
    assert torch.equal(extras["rng"], torch.arange(3))
    store.write(4, state_of(4), {}, engine)  # restoring 2 made it the newest: 3 is overwritten
    assert again.read(2, engine)[1]["leaves"]["optim.param_groups"][0]["lr"] == 0.2
    with pytest.raises(FileNotFoundError, match=r"steps \[2, 4\]"):
        again.read(3, engine)
    with pytest.raises(ValueError, match=r"taken by an engine of \{'dp': 1\}"):
        again.read(4, {"dp": 2})
    (tmp_path / "rank0" / "slot0" / "model.w.bin").write_bytes(b"\0" * 8)
    with pytest.raises(FileNotFoundError, match=r"model.w.bin is 8 bytes"):
        RankSnapshots(tmp_path, 0).read(4, engine)


def test_megatron_refuses_snapshots_naming_the_alternative(tmp_path: Path) -> None:
    assert MegatronEngine.snapshot is TrainingEngine.snapshot
    assert MegatronEngine.restore_snapshot is TrainingEngine.restore_snapshot
    engine = MegatronEngine.__new__(MegatronEngine)  # the default needs no state
    with pytest.raises(NotImplementedError, match=r"backend: fsdp only.*trainer.save_every"):
        engine.snapshot(tmp_path, 0)
    with pytest.raises(NotImplementedError, match=r"backend: fsdp only"):
        engine.restore_snapshot(tmp_path, 0)
