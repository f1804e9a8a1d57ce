"""A stranger on the controller's socket can neither wedge it nor make it hoard memory or logs.

Issue 21, 2a and 2b. The stranger never has the token. Three probes: 20,000 fuzzed messages fed
straight to the controller's message handler (nothing may escape it, every one is refused exactly
once); a run that keeps calling a real group while another process cycles connect / odd hello /
leave against its TCP port; and three messages built to exhaust memory (a 1 GiB frame, a 32 MB
header of empty maps, a 60 MB string as ``version``), after each of which the controller's
resident memory is back within 50 MB of its baseline, its peak never grew by more than the frame
ZeroMQ had to receive (no decoding blow-up), and the real group's calls are unaffected.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq

from controller.rejections import KEEP, REASON_CHARS
from controller.server import Controller
from deploy.session import local_session
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.clients import EchoClient
from transport.codec import encode
from transport.protocol import PROTOCOL_VERSION, Message, MsgType

ECHO = "tests.fixtures.roles:Echo"
REPO = Path(__file__).resolve().parents[2]
MB = 1 << 20
FUZZ_MESSAGES = 20_000
CYCLES = 10_000


# ------------------------------------------------------------------------------------------ fuzz
def _value(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-able value: scalars of every kind, odd extensions, nested containers."""
    kind = rng.randrange(11 if depth < 3 else 8)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.randrange(-5, 70)
    if kind == 2:
        return rng.choice([-(2**63), 2**64 - 1, 2**31, -1])
    if kind == 3:
        return rng.choice([0.5, -0.0, math.inf, -math.inf, math.nan, 1e308])
    if kind == 4:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(12)))
    if kind == 5:
        return rng.randbytes(rng.randrange(12))
    if kind == 6:
        return msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.randrange(20)))
    if kind == 7:
        return rng.choice(["echo", "g", "_group", "x" * rng.randrange(3000)])
    if kind == 8:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if kind == 9:
        return {_value(rng, 3): _value(rng, depth + 1) for _ in range(rng.randrange(5))}
    return torch.arange(rng.randrange(200), dtype=torch.float32)  # encoded by the codec


def _hello_body(rng: random.Random, token: str) -> dict[str, Any]:
    """A hello that is right in most fields and wrong (odd type, missing, odd value) in 1-3."""
    body: dict[str, Any] = {
        "roles": ["echo"],
        "world_size": 1,
        "layout": {"dp": 1, "tp": 1, "pp": 1},
        "version": PROTOCOL_VERSION,
        "token": token if rng.random() < 0.5 else "wrong",
        "host": "h",
        "pid": 1,
        "rank": 0,
        "group": "g",
    }
    odd = [5, [1, "a"], torch.ones(3), "1", None, {"dp": "1"}, [], ["echo", "echo"], 2.0, True]
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(list(body))
        roll = rng.random()
        if roll < 0.2:
            del body[key]
        elif roll < 0.6:
            body[key] = rng.choice(odd)
        else:
            body[key] = _value(rng)
    return body


def _frames(rng: random.Random, token: str) -> list[bytes]:
    roll = rng.random()
    if roll < 0.45:
        frames = [
            bytes(f) for f in encode(Message(MsgType.HELLO, 0, _hello_body(rng, token))).frames
        ]
    elif roll < 0.7:
        msg_type = MsgType(rng.randrange(1, 9))
        body = {k: _value(rng) for k in ("role", "rank", "cause", "result", "roles", "reason")}
        if rng.random() < 0.3:
            body = _value(rng)
        frames = [bytes(f) for f in encode(Message(msg_type, rng.randrange(99), body)).frames]
    else:
        type_code = rng.choice([rng.randrange(-3, 12), "1", None, 1.0])
        header = [PROTOCOL_VERSION, type_code, rng.choice([0, -1, "x", 2**64 - 1]), _value(rng)]
        frames = [msgpack.packb(header, default=lambda t: t.tolist())]
    if rng.random() < 0.3:  # truncate, extend or drop frames
        cut = rng.randrange(len(frames[0]) + 1)
        frames[0] = frames[0][:cut] + (
            rng.randbytes(rng.randrange(4)) if rng.random() < 0.5 else b""
        )
    if rng.random() < 0.1:
        frames.append(rng.randbytes(rng.randrange(100)))
    if rng.random() < 0.05 and len(frames) > 1:
        frames.pop()
    return frames


def test_twenty_thousand_fuzzed_messages_from_a_stranger_escape_nothing() -> None:
    rng = random.Random(21)

    async def main() -> tuple[Controller, float]:
        async with local_session([group("g", 1, echo=ECHO)], TEST_TIMEOUTS) as c:
            echo = EchoClient(c, "echo")
            sock, watch = c._sockets[0]
            stranger = zmq.Frame(b"\x00stranger")  # not connected: every refusal is undeliverable
            started = time.monotonic()
            for i in range(FUZZ_MESSAGES):
                frames = _frames(rng, c.token)
                c._handle(sock, watch, stranger, [zmq.Frame(f) for f in frames])
                if i % 2000 == 0:
                    await asyncio.sleep(0)
                    assert await echo.echo(i, timeout=10) == i
            took = time.monotonic() - started
            assert await echo.echo("after", timeout=10) == "after"
            assert (await echo.where(timeout=10))["ranks"] == [0]
            return c, took

    c, took = run(main)
    print(f"{FUZZ_MESSAGES} fuzzed messages handled in {took:.1f} s")
    assert c.rejections.total == FUZZ_MESSAGES  # each refused exactly once, none accepted
    assert len(c.rejected) <= KEEP
    assert all(len(r) <= REASON_CHARS + 40 for r in c.rejected)
    assert not [r for r in c.rejected if "broke" in r], "a message got past validation"


def test_odd_hellos_are_refused_with_a_reason_naming_the_field() -> None:
    async def main() -> list[str]:
        controller = Controller([group("g", 1, echo=ECHO)], TEST_TIMEOUTS)
        controller.bind("ipc:///tmp/hf-odd-hello-test")
        sock, watch = controller._sockets[0]
        good = {
            "roles": ["echo"],
            "world_size": 1,
            "layout": {"dp": 1, "tp": 1, "pp": 1},
            "version": PROTOCOL_VERSION,
            "token": controller.token,
            "host": "h",
            "pid": 1,
            "group": "g",
        }
        odd: list[dict[str, Any]] = [
            {"roles": 5},
            {"roles": [1, "a"]},
            {"version": torch.ones(2)},
            {"version": "1"},
            {"world_size": "1"},
            {"layout": 7},
            {"host": 3},
            {"token": 12},
            {"group": ["g"]},
        ]
        try:
            for change in odd:
                body = {**good, **change}
                frames = encode(Message(MsgType.HELLO, 0, body)).frames
                controller._hello(sock, watch, zmq.Frame(b"\x00who"), body)
                controller._handle(sock, watch, zmq.Frame(b"\x00who"), frames)
        finally:
            await controller.shutdown()
        return controller.rejected

    rejected = run(main)
    assert len(rejected) == 18, rejected
    for field, reason in zip(
        ["roles", "roles", "version", "version", "world_size", "layout", "host", "token", "group"],
        rejected[::2],
        strict=True,
    ):
        assert field in reason, (field, reason)


# -------------------------------------------------------------------------------------- live run
def _stranger(address: str, attack: str, count: int) -> list[str]:
    return [sys.executable, "-m", "tests.controller.hostile_peer", address, attack, str(count)]


def test_run_keeps_stepping_while_strangers_cycle_connect_hello_leave() -> None:
    async def main() -> tuple[list[float], int, int, str]:
        async with local_session(
            [group("g", 1, echo=ECHO)], TEST_TIMEOUTS, bind="tcp://127.0.0.1:0"
        ) as c:
            echo = EchoClient(c, "echo")
            proc = await asyncio.create_subprocess_exec(
                *_stranger(c.addresses[0], "cycles", CYCLES),
                cwd=REPO,
                stdout=asyncio.subprocess.PIPE,
            )
            gaps, last, step = [], time.monotonic(), 0
            async with asyncio.timeout(60):
                while proc.returncode is None:
                    assert await echo.echo(step, timeout=10) == step
                    step += 1
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    try:  # poll the stranger without blocking the steps
                        await asyncio.wait_for(asyncio.shield(proc.wait()), 0.001)
                    except TimeoutError:
                        pass
                out = (await proc.communicate())[0].decode()
                while c.rejections.total < CYCLES * 0.9:
                    await asyncio.sleep(0.05)
            for i in range(20):  # and after it: every call answered at once
                assert await echo.echo(i, timeout=5) == i
            return gaps, c.rejections.total, len(c.rejected), out

    gaps, total, kept, out = run(main)
    print(f"stranger: {out.strip()}; {len(gaps)} steps meanwhile, longest gap {max(gaps):.2f} s")
    assert len(gaps) >= 10
    assert max(gaps) < 5.0
    assert total >= CYCLES * 0.9
    assert kept <= KEEP


# ---------------------------------------------------------------------------------------- memory
def _status(field: str) -> int:
    """A /proc/self/status memory field in bytes (VmRSS now, VmHWM the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


# A 1 GiB frame is the probe, and it is practical here: the stranger's zero pages cost it
# nothing, and the controller holds the frame only until it sees the sender (ZeroMQ must receive
# a whole frame before the application sees its sender; the peak shows that and nothing more).
ATTACKS = [("big-frame", 1 << 30), ("empty-maps", 32 * MB), ("long-version", 60 * MB)]


def test_memory_attacks_from_a_stranger_leave_rss_flat_and_calls_unaffected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> list[tuple[str, int, int, int]]:
        async with local_session([group("g", 1, echo=ECHO)], TEST_TIMEOUTS) as c:
            echo = EchoClient(c, "echo")
            for i in range(20):
                assert await echo.echo(i) == i
            gc.collect()
            baseline = _status("VmRSS")
            seen = []
            for attack, size in ATTACKS:
                before = c.rejections.total
                _reset_peak()
                proc = await asyncio.create_subprocess_exec(
                    *_stranger(c.addresses[0], attack, size), cwd=REPO
                )
                async with asyncio.timeout(60):
                    assert await proc.wait() == 0
                    while c.rejections.total == before:
                        assert await echo.echo(attack) == attack
                        await asyncio.sleep(0.02)
                assert await echo.echo(attack) == attack
                gc.collect()
                seen.append(
                    (attack, size, _status("VmHWM") - baseline, _status("VmRSS") - baseline)
                )
            return seen

    with caplog.at_level(logging.WARNING, logger="hybridflow.controller"):
        seen = run(main)
    for attack, size, peak, after in seen:
        print(
            f"{attack}: {size / MB:.0f} MB sent, peak +{peak / MB:.1f} MB, after +{after / MB:.1f} MB"
        )
        assert after < 50 * MB, (attack, after)
        assert peak < size + 50 * MB, (attack, peak)  # nothing decoded, nothing amplified
    assert all(len(r.getMessage()) < 1000 for r in caplog.records)
