"""A multi-turn rollout that fails still closes its sessions (``controller/agent.py``
``run_trajectories``): the env group's and the generator's KV of them, and the rollout's own error
is the one the caller sees. The generator and the env group are scripted (what is under test is
the bookkeeping; real groups run in ``tests/controller/test_agent.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controller.agent import AgentConfig, AgentRollout, run_trajectories
from tests.fixtures.clients import ONE_RANK
from transport.agent import EnvOpen, EnvResult, EnvSpec
from transport.batch import TensorBatch
from transport.sampling import SamplingConfig

EOS, GT = 2, 7


class DyingGenerator:
    """A one-rank generator whose every call fails, as a group that died mid-rollout."""

    role = "actor"
    controller = ONE_RANK

    def __init__(self) -> None:
        self.dropped: list[str] = []

    async def generate(self, *args: Any) -> Any:
        raise RuntimeError("the actor group died")

    async def drop_sessions(self, keys: list[str]) -> int:
        self.dropped += keys
        return len(keys)


class Sessions:
    """The env group's session bookkeeping: what is open."""

    def __init__(self) -> None:
        self.open_now: set[int] = set()

    async def open(self, sessions: list[EnvOpen]) -> list[EnvResult]:
        self.open_now |= {s.session for s in sessions}
        return [EnvResult(session=s.session, observation_ids=[1, 3]) for s in sessions]

    async def close(self, sessions: list[int]) -> int:
        closed = self.open_now & set(sessions)
        self.open_now -= closed
        return len(closed)


def test_a_failed_rollout_closes_its_env_sessions_and_the_generators_kv() -> None:
    env, generator = Sessions(), DyingGenerator()
    spec = EnvSpec(eos_token_id=EOS, call_stop_token_ids=[GT], call_close=">", format="bracket")
    setup = AgentRollout(generator, env, AgentConfig(max_turns=2), spec, first_session=40)  # type: ignore[arg-type]
    prompts = TensorBatch.from_dict(non_tensors={"prompt": ["a", "b"], "seed": [1, 2]})
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4, n=2)
    with pytest.raises(RuntimeError, match="the actor group died"):
        asyncio.run(run_trajectories(setup, prompts, sampling, 0))
    assert env.open_now == set()
    assert sorted(generator.dropped) == [f"t{40 + i}" for i in range(4)]
