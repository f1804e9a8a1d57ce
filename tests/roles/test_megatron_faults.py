"""kill -9 of a pipeline rank in the middle of a megatron training step: the controller gets one
clear error naming the role, the rank and SIGKILL within seconds, and no process of the group
is left behind — the other stage, blocked in the pipeline's send/receive, does not hang the run.

The step's loss sleeps on the last stage, so the first stage waits on it in the schedule: the
victim is either that waiting rank (rank 0, the coordinator) or the one in its loss (rank 1). The
kill comes once both are seen there: the last stage has created a file on entering its loss, and
the first stage's main thread sleeps and has used no CPU for a while (``tests.waiting.Blocked``)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from deploy.session import local_session
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.clients import EchoClient, SlowActorClient
from tests.roles.test_mesh import ECHO, pid_alive
from tests.roles.test_training import token_batch
from tests.waiting import Blocked, wait_for, wait_until
from transport.errors import RoleDeadError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [0, pytest.param(1, marks=pytest.mark.extended)])
def test_kill_9_of_a_pipeline_rank_mid_step_raises_role_dead_within_5s(
    tiny: Path, victim: int, tmp_path: Path
) -> None:
    config = {"model": str(tiny), "backend": "megatron", "dtype": "fp32", "micro_batch_size": 2}
    timeouts = TEST_TIMEOUTS.model_copy(update={"connect_s": 180})

    async def main() -> list[int]:
        placement = [
            group("g", 2, pp=2, actor=("tests.fixtures.actor:SlowActor", config), echo=ECHO)
        ]
        async with local_session(placement, timeouts) as c:
            pids = (await EchoClient(c, "echo").where())["pids"]
            in_loss = tmp_path / "in-loss"
            pending = asyncio.ensure_future(
                SlowActorClient(c, "actor").slow_step(token_batch(4, 1), 30.0, str(in_loss))
            )
            # in the schedule: stage 1 has entered its loss (it made the file) ...
            await wait_until(
                lambda: in_loss.exists() or pending.done(),
                120,
                f"the last stage entering its loss (creating {in_loss})",
            )
            assert not pending.done(), pending.result()  # the step is still in its loss
            # ... and stage 0, its forwards done, is blocked in the pipeline's receive
            await wait_until(
                Blocked(pids[0], pids[0]), 30, "stage 0's main thread blocked in the schedule"
            )
            assert not pending.done(), pending.result()
            os.kill(pids[victim], signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(RoleDeadError) as info:
                await pending
            assert time.monotonic() - killed < 5.0
            assert info.value.rank == victim and "SIGKILL" in str(info.value)
            return list(pids)

    pids = run(main)
    wait_for(lambda: not any(pid_alive(p) for p in pids), 10, "both pipeline ranks gone")
