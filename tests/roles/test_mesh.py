"""The mesh end to end: a controller in this process, groups as real rank processes with real gloo
groups, real sockets. Each test starts its own session, so a failure cannot leak into the next."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from controller.clients import ProtocolMismatchError
from deploy.session import local_session
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.clients import EchoClient, FaultyClient
from tests.waiting import cpu_seconds, wait_for, wait_until
from transport.batch import TensorBatch
from transport.errors import CallTimeoutError, RemoteError, RoleDeadError
from transport.protocol import Transfer

ECHO = "tests.fixtures.roles:Echo"
FAULTY = "tests.fixtures.roles:Faulty"
BUSY_S = 0.2  # CPU seconds a rank spends only when it runs a call (an idle one waits on sockets)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


@pytest.mark.parametrize("fanout", ["socket", "zmq", "rpc"])
def test_one_to_all_runs_spmd_on_every_rank(fanout: str) -> None:
    async def main() -> None:
        async with local_session([group("g", 2, fanout=fanout, echo=ECHO)], TEST_TIMEOUTS) as c:
            echo = EchoClient(c, "echo")
            seen = await echo.where()
            assert seen["rank"] == 0  # one-to-all collects rank 0's result
            assert seen["ranks"] == [0, 1]
            assert len(set(seen["pids"])) == 2 and os.getpid() not in seen["pids"]
            value = {"a": [1, 2.5, "x"], "t": torch.arange(6).reshape(2, 3)}
            back = await echo.echo(value)
            assert back["a"] == [1, 2.5, "x"] and torch.equal(back["t"], value["t"])
            assert (await echo.where())["calls"] == [1, 1]  # both ranks ran echo once

    run(main)


@pytest.mark.parametrize("fanout", ["socket", "zmq", "rpc"])
def test_dp_split_shards_by_dp_rank_and_collects_tp_rank_zero(fanout: str) -> None:
    async def main() -> None:
        placement = [group("g", 4, tp=2, fanout=fanout, echo=ECHO)]  # dp=2 x tp=2
        async with local_session(placement, TEST_TIMEOUTS) as c:
            echo = EchoClient(c, "echo")
            batch = TensorBatch.from_dict({"x": torch.arange(6)}, {"id": list("abcdef")})
            out = await echo.shard_info(batch)
            assert out["x"].tolist() == [0, 1, 2, 3, 4, 5]  # order kept
            assert out["id"] == list("abcdef")
            assert out["dp_rank"].tolist() == [0, 0, 0, 1, 1, 1]
            assert out["tp_rank"].tolist() == [0] * 6  # collected from tp rank 0 only
            assert out["seen_by"].tolist() == [0, 0, 0, 2, 2, 2]
            # non-TensorBatch results come back one per dp rank; uneven batches split 3 + 2
            uneven = TensorBatch.from_dict({"x": torch.arange(5)})
            assert await echo.shard_sizes(uneven) == [3, 2]

    run(main)


def test_rank_zero_runs_only_on_rank_zero() -> None:
    async def main() -> None:
        async with local_session([group("g", 2, echo=ECHO)], TEST_TIMEOUTS) as c:
            echo = EchoClient(c, "echo")
            assert await echo.only_zero() == 0
            assert (await echo.where())["calls"] == [1, 0]

    run(main)


def test_colocated_roles_share_ranks_but_keep_their_own_state() -> None:
    async def main() -> None:
        placement = [
            group("shared", 2, a=(ECHO, {"tag": "a"}), b=(ECHO, {"tag": "b"}), f=FAULTY),
            group("alone", 1, c=(ECHO, {"tag": "c"})),
        ]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            a, b, other = EchoClient(c, "a"), EchoClient(c, "b"), EchoClient(c, "c")
            await a.echo(1)
            wa, wb, wc = await asyncio.gather(a.where(), b.where(), other.where())
            assert (wa["tag"], wb["tag"], wc["tag"]) == ("a", "b", "c")
            assert wa["pids"] == wb["pids"]  # same processes host a and b
            assert not set(wa["pids"]) & set(wc["pids"])
            assert wa["calls"] == [1, 1] and wb["calls"] == [0, 0]
            assert set(a.endpoints) >= {"echo", "where", "shard_info"}

    run(main)


@pytest.mark.parametrize("fanout", ["socket", "zmq", "rpc"])
def test_exception_on_a_rank_becomes_remote_error_and_group_stays_usable(fanout: str) -> None:
    async def main() -> None:
        placement = [group("g", 2, fanout=fanout, f=FAULTY, echo=ECHO)]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            faulty = FaultyClient(c, "f")
            for rank in (1, 0):
                with pytest.raises(RemoteError) as info:
                    await faulty.fail_on(rank, message="kaput")
                err = info.value
                assert (err.role, err.rank, err.exc_type) == ("f", rank, "ValueError")
                assert f"kaput on rank {rank}" in err.remote_traceback
                assert "fail_on" in err.remote_traceback  # the remote frame, not ours
            assert await faulty.fail_on(5) == 0  # nobody fails: rank 0's result
            assert (await EchoClient(c, "echo").where())["ranks"] == [0, 1]

    run(main)


def test_unsendable_result_and_unknown_names_give_clear_errors() -> None:
    async def main() -> None:
        async with local_session([group("g", 2, f=FAULTY)], TEST_TIMEOUTS) as c:
            faulty = FaultyClient(c, "f")
            with pytest.raises(RemoteError, match="no pickle"):
                await faulty.unsendable()
            # the generic path, by name: the client checks before sending, the controller too
            with pytest.raises(AttributeError, match="no endpoint 'nope'"):
                await faulty._call(Transfer.ONE_TO_ALL, "nope")
            with pytest.raises(AttributeError, match="no endpoint 'nope'"):
                await c.call("f", "nope", [], {})
            with pytest.raises(ProtocolMismatchError, match=r"'rank-zero'.*'one-to-all'"):
                await faulty._call(Transfer.RANK_ZERO, "pid")
            with pytest.raises(KeyError, match="no role 'ghost'"):
                EchoClient(c, "ghost")
            assert await faulty.fail_on(-1) == 0

    run(main)


def test_call_timeout_names_the_setting_and_group_survives() -> None:
    async def main() -> None:
        async with local_session([group("g", 2, f=FAULTY)], TEST_TIMEOUTS) as c:
            faulty = FaultyClient(c, "f")
            started = time.monotonic()
            with pytest.raises(CallTimeoutError, match=r"timeouts\.call_s"):
                await faulty.sleep(2.0, timeout=0.3)
            assert time.monotonic() - started < 1.5
            assert await faulty.fail_on(-1) == 0  # queued behind the sleep, then fine

    run(main)


@pytest.mark.parametrize(
    ("victim", "fanout"), [(1, "socket"), (0, "socket"), (1, "zmq"), (1, "rpc")]
)
def test_kill_9_of_a_rank_mid_call_raises_role_dead_within_5s(victim: int, fanout: str) -> None:
    async def main() -> list[int]:
        placement = [group("g", 2, fanout=fanout, f=FAULTY, echo=ECHO)]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            pids = (await EchoClient(c, "echo").where())["pids"]
            faulty = FaultyClient(c, "f")
            idle = [cpu_seconds(p) for p in pids]
            pending = asyncio.ensure_future(faulty.sleep(30.0))
            # mid-call: every rank is in the busy loop of ``sleep`` (an idle rank burns ~no CPU)
            await wait_until(
                lambda: all(cpu_seconds(p) - t >= BUSY_S for p, t in zip(pids, idle, strict=True)),
                20,
                f"every rank of the group computing the call ({BUSY_S} s of CPU each)",
            )
            assert not pending.done()
            os.kill(pids[victim], signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(RoleDeadError) as info:
                await pending
            assert time.monotonic() - killed < 5.0
            assert info.value.role == "f" and info.value.rank == victim
            assert "SIGKILL" in str(info.value)
            with pytest.raises(RoleDeadError, match="SIGKILL"):  # sticky, for every role there
                await EchoClient(c, "echo").where()
            return pids

    pids = run(main)
    wait_for(lambda: not any(pid_alive(p) for p in pids), 5, "every rank of the group gone")


@pytest.mark.extended
@pytest.mark.slow
def test_long_compute_over_tcp_with_short_heartbeats_is_not_a_death() -> None:
    timeouts = TEST_TIMEOUTS.model_copy(update={"heartbeat_s": 0.5, "heartbeat_timeout_s": 2.0})

    async def main() -> None:
        async with local_session(
            [group("g", 2, f=FAULTY)], timeouts, bind="tcp://127.0.0.1:0"
        ) as c:
            took = await FaultyClient(c, "f").sleep(20.0)
            assert took >= 20.0
            assert await FaultyClient(c, "f").fail_on(-1) == 0

    run(main)


def test_big_tensors_cross_in_both_directions_intact() -> None:
    async def main() -> None:
        async with local_session([group("g", 2, echo=ECHO)], TEST_TIMEOUTS) as c:
            echo = EchoClient(c, "echo")
            for numel in (100, 70_000, 3_000_000):  # inline, zmq frame, shared memory
                t = torch.randn(numel, dtype=torch.float32)
                raw = t.view(torch.int32)
                expected = int(raw.view(torch.uint8)[: numel * 4 // 8 * 8].view(torch.int64).sum())
                assert await echo.checksum(t) == expected
                back = await echo.echo(t)
                assert torch.equal(back, t)
                t.add_(1)  # after the call returned, mutating ours must not affect theirs
                assert not torch.equal(back, t)

    run(main)


def test_a_silent_remote_peer_is_dropped_by_zeromq_heartbeats() -> None:
    """A coordinator that stops answering (SIGSTOP: a hung host) is declared dead by ZeroMQ's
    own heartbeats over TCP, without any application-level ping."""
    timeouts = TEST_TIMEOUTS.model_copy(update={"heartbeat_s": 0.3, "heartbeat_timeout_s": 1.5})

    async def main() -> None:
        async with local_session(
            [group("g", 1, echo=ECHO)], timeouts, bind="tcp://127.0.0.1:0"
        ) as c:
            echo = EchoClient(c, "echo")
            pid = (await echo.where())["pids"][0]
            c.local_groups.clear()  # judge by the socket alone, as for a remote host
            pending = asyncio.ensure_future(echo.echo(1))
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                with pytest.raises(RoleDeadError, match="heartbeats timed out"):
                    await pending
                assert time.monotonic() - stopped < 5.0
            finally:
                os.kill(pid, signal.SIGKILL)

    run(main)
