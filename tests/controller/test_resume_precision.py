"""A checkpoint records the dtype each role computed in; resuming where a role now resolves to
another dtype (``dtype: auto`` decided again at the start) is refused, naming the role, both
dtypes and the setting that fixes it, before any state is loaded."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, cast

import pytest

from controller.clients import ActorClient, EngineClient, RewardClient
from controller.steps import Roles
from controller.trainer import PrecisionChanged, SFTStage, Trainer, TrainerConfig


class FakeEngine:
    """The part of an engine client a resume asks before it loads anything."""

    def __init__(self, role: str, dtype: str) -> None:
        self.role, self.dtype = role, dtype
        self.loaded: list[str] = []

    async def precision(self, *, timeout: float | None = None) -> dict[str, str]:
        return {"dtype": self.dtype, "reason": "auto: bf16 matmul runs 0.90x fp32 on this CPU"}

    async def configure_optim(self, optim: Any, *, timeout: float | None = None) -> None:
        pass

    async def load(self, path: str, *, timeout: float | None = None) -> None:
        self.loaded.append(path)


def trainer(run_dir: Path, engines: dict[str, FakeEngine]) -> Trainer:
    actor = cast(ActorClient, engines["actor"])
    roles = Roles(actor=actor, reward=cast(RewardClient, object()))
    clients = cast(dict[str, EngineClient], engines)
    stage = SFTStage(name="sft", steps=4, data="rows")
    return Trainer(TrainerConfig(), [stage], roles, clients, {"rows": []}, run_dir, ["actor"])


def checkpoint(run_dir: Path, precision: dict[str, str]) -> Path:
    found = run_dir / "checkpoints" / "step_000002"
    found.mkdir(parents=True)
    state = {
        "stage": 0,
        "stage_step": 2,
        "global_step": 2,
        "data_position": 64,
        "algorithm": None,
        "validations": [],
        "precision": {role: {"dtype": d, "reason": "auto: probe"} for role, d in precision.items()},
    }
    (found / "controller.json").write_text(json.dumps(state))
    return found


def test_a_role_whose_dtype_changed_is_refused_naming_it_and_the_fix(tmp_path: Path) -> None:
    saved = checkpoint(tmp_path, {"actor": "bf16", "critic": "fp32"})
    engines = {"actor": FakeEngine("actor", "fp32"), "critic": FakeEngine("critic", "fp32")}
    with pytest.raises(PrecisionChanged) as refused:
        asyncio.run(trainer(tmp_path, engines).run(resume=True))
    message = str(refused.value)
    assert str(saved) in message
    assert "role 'actor' computed in bf16 then, now in fp32" in message
    assert "--set roles.actor.dtype=bf16" in message
    assert "critic" not in message  # unchanged: not named
    assert engines["actor"].loaded == []  # refused before any weights were loaded


def test_the_same_dtype_and_a_checkpoint_without_one_resume(tmp_path: Path) -> None:
    for run_dir, recorded in ((tmp_path / "same", {"actor": "fp32"}), (tmp_path / "old", {})):
        checkpoint(run_dir, recorded)
        engines = {"actor": FakeEngine("actor", "fp32")}
        resumed = trainer(run_dir, engines)

        async def restore(t: Trainer = resumed) -> tuple[int, int]:
            t.precision = await t._precision()  # as a run does first
            return await t._restore()

        assert asyncio.run(restore()) == (0, 2)
        assert engines["actor"].loaded and resumed.global_step == 2
