"""The mesh at scale, simulated: one controller and up to 64 coordinators with fake ranks.

``python -m bench.mesh_scale [--quick] [--groups 1,4,16,64] [--ranks 1,4,16]`` (about a minute).

The controller is the real one (``controller.server.Controller``, uvloop), over TCP on this
host. Each group is a fake coordinator: its own process, forked from this one before the
controller's ZeroMQ context exists, speaking the real wire protocol (HELLO, WELCOME, the build
call, CALL, REPLY, SHUTDOWN; msgpack through ``transport.codec``). Behind each coordinator sit
``R - 1`` fake ranks: threads of the coordinator's process, each with its own ZeroMQ socket, so
a call really fans out as ``R - 1`` messages and comes back as ``R - 1`` replies (rank 0 is the
coordinator, as in the real group). No rank computes anything.

A **one-to-all call** is ``Controller.call`` to every group at once (``asyncio.gather``), each
group forwarding it to all its ranks and replying when they all have. Per configuration
(groups G, ranks per group R), after warm-up calls:

- ``p50_ms`` / ``p99_ms``: the one-to-all call's latency;
- ``ctrl_cpu_us_per_call``: the controller process's CPU time (its event loop and its ZeroMQ
  I/O thread) per call, and per group;
- ``ctrl_msgs_per_call``: messages the controller sent per call (counted at ``_send``) and
  received (replies resolved); ``ctrl_bytes_per_call``: the bytes it sent;
  ``rank_msgs_per_call``: the rank replies the coordinators gathered (G x (R - 1)).

What it shows: the controller's messages, bytes and CPU per call grow with the number of groups
and do not depend on R. The latency at 16 ranks per group is bounded by this machine: all G x R
fake ranks share 2 cores, so at large G x R each call waits for about G x R thread wake-ups.
``coord_cpu_us_per_rank`` (the coordinators' CPU per call, per rank) says how much of the
latency that is. On a cluster every coordinator and rank has its own core.

The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import threading
import time
from typing import Any

import zmq
from rich.console import Console
from rich.table import Table

from controller.placement import GroupSpec, RoleSpec
from controller.server import Controller
from deploy.terminal import run_async  # on uvloop where installed
from transport.channel import connect_dealer, host_id, send_frames, spare_port
from transport.codec import decode, encode
from transport.protocol import PROTOCOL_VERSION, Layout, Message, MsgType, Transfer
from transport.settings import Timeouts

ROLE_CLS = "tests.fixtures.roles:Echo"  # never imported: fake coordinators answer the build
READY_TIMEOUT_S = 60.0


# -- the fake coordinator (a forked process) ------------------------------------------------
def _rank_thread(ctx: zmq.Context[Any], address: str, rank: int) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, rank.to_bytes(2, "big"))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    send_frames(sock, encode(Message(MsgType.HELLO, 0, {"rank": rank})))
    while True:
        msg = decode(sock.recv_multipart(copy=False))
        if msg.type == MsgType.SHUTDOWN:
            break
        send_frames(sock, encode(Message(MsgType.REPLY, msg.call_id, {"result": None})))
    sock.close()


def coordinator(address: str, token: str, group: str, role: str, ranks: int) -> None:
    """A group's rank 0: registers, answers the build, forwards each call to its ranks."""
    ctx: zmq.Context[Any] = zmq.Context()
    fan = ctx.socket(zmq.ROUTER)
    fan.setsockopt(zmq.LINGER, 0)
    fan_address = f"inproc://ranks-{group}"
    fan.bind(fan_address)
    threads = [
        threading.Thread(target=_rank_thread, args=(ctx, fan_address, r), daemon=True)
        for r in range(1, ranks)
    ]
    for t in threads:
        t.start()
    peers = [fan.recv_multipart()[0] for _ in threads]  # each rank's hello
    ctrl = connect_dealer(ctx, address, f"{group}:{os.getpid()}".encode(), Timeouts())
    hello = {
        "roles": [role], "world_size": ranks, "layout": Layout.for_world(ranks).to_wire(),
        "version": PROTOCOL_VERSION, "token": token, "host": host_id(), "pid": os.getpid(),
        "rank": 0, "group": group,
    }  # fmt: skip
    send_frames(ctrl, encode(Message(MsgType.HELLO, 0, hello)))
    cpu, rank_msgs = 0.0, 0
    while True:
        msg = decode(ctrl.recv_multipart(copy=False))
        start = time.process_time()
        if msg.type == MsgType.SHUTDOWN:
            break
        if msg.type != MsgType.CALL:
            continue  # the WELCOME
        if msg.body["method"] == "build":
            result: Any = {role: {m: str(Transfer.ONE_TO_ALL) for m in ("ping", "cpu")}}
        elif msg.body["method"] == "cpu":
            result = {"cpu": cpu, "rank_msgs": rank_msgs}
        else:
            forward = encode(Message(MsgType.CALL, msg.call_id, msg.body))
            for peer in peers:
                send_frames(fan, forward, peer)
            for _ in peers:
                decode(fan.recv_multipart(copy=False)[1:])
                rank_msgs += 1
            result = None
        send_frames(ctrl, encode(Message(MsgType.REPLY, msg.call_id, {"result": result})))
        cpu += time.process_time() - start
    stop = encode(Message(MsgType.SHUTDOWN, 0, {}))
    for peer in peers:
        send_frames(fan, stop, peer)
    for t in threads:
        t.join(timeout=5)
    ctx.destroy(linger=0)


# -- the controller side --------------------------------------------------------------------
class CountingController(Controller):
    """The real controller, counting the messages it sends and the replies it resolves."""

    def __init__(self, groups: list[GroupSpec], token: str) -> None:
        super().__init__(groups, token=token)
        self.sent_msgs = 0
        self.resolved = 0

    def _send(self, sock: Any, identity: bytes, msg: Message, arena: bool) -> None:
        self.sent_msgs += 1
        super()._send(sock, identity, msg, arena)

    def _resolve(self, group: Any, msg: Message) -> None:
        self.resolved += 1
        super()._resolve(group, msg)


def role_name(g: int) -> str:
    return f"sim{g}"


async def drive(
    address: str, specs: list[GroupSpec], token: str, calls: int, warmup: int
) -> dict[str, Any]:
    ctrl = CountingController(specs, token)
    ctrl.bind(address)
    try:
        await ctrl.wait_ready(READY_TIMEOUT_S)
        roles = [role_name(g) for g in range(len(specs))]

        async def one_to_all(method: str = "ping") -> list[Any]:
            return list(await asyncio.gather(*(ctrl.call(r, method, [], {}) for r in roles)))

        for _ in range(warmup):
            await one_to_all()
        before = await one_to_all("cpu")
        sent0, got0, bytes0 = ctrl.sent_msgs, ctrl.resolved, ctrl.traffic.sent
        cpu0 = time.process_time()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            await one_to_all()
            times.append(time.perf_counter() - start)
        cpu = time.process_time() - cpu0
        sent, got, nbytes = ctrl.sent_msgs - sent0, ctrl.resolved - got0, ctrl.traffic.sent - bytes0
        after = await one_to_all("cpu")
        coord_cpu = sum(a["cpu"] - b["cpu"] for a, b in zip(after, before, strict=True))
        rank_msgs = sum(a["rank_msgs"] - b["rank_msgs"] for a, b in zip(after, before, strict=True))
    finally:
        await ctrl.shutdown()
    ranks = specs[0].nproc
    times.sort()
    return {
        "groups": len(specs),
        "ranks_per_group": ranks,
        "calls": calls,
        "p50_ms": 1e3 * statistics.median(times),
        "p99_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))],
        "ctrl_cpu_us_per_call": 1e6 * cpu / calls,
        "ctrl_cpu_us_per_group": 1e6 * cpu / calls / len(specs),
        "ctrl_msgs_per_call": sent / calls,
        "ctrl_replies_per_call": got / calls,
        "ctrl_bytes_per_call": nbytes / calls,
        "coord_cpu_us_per_rank": 1e6 * coord_cpu / calls / (len(specs) * ranks),
        "rank_msgs_per_call": rank_msgs / calls,
    }


def measure(groups: int, ranks: int, calls: int, warmup: int = 20) -> dict[str, Any]:
    """One configuration: fork the coordinators, drive them from a controller here, reap them."""
    port = spare_port()
    address = f"tcp://127.0.0.1:{port}"
    token = "mesh-scale-" + os.urandom(8).hex()
    specs = [
        GroupSpec(name=f"g{g}", roles={role_name(g): RoleSpec(cls=ROLE_CLS)}, nproc=ranks)
        for g in range(groups)
    ]
    ctx = mp.get_context("fork")  # before any ZeroMQ context here: the children share nothing
    procs = [
        ctx.Process(target=coordinator, args=(address, token, s.name, role_name(g), ranks))
        for g, s in enumerate(specs)
    ]
    for p in procs:
        p.start()
    try:
        return run_async(lambda: drive(address, specs, token, calls, warmup))
    finally:
        for p in procs:
            p.join(timeout=10)
        left = [p for p in procs if p.is_alive()]
        for p in left:
            p.kill()
            p.join()
        bad = [p.exitcode for p in procs if p.exitcode != 0]
        if left or bad:
            raise RuntimeError(f"{len(left)} coordinators did not stop; exit codes {bad}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="groups 1,8; ranks 1,4; fewer calls")
    ap.add_argument("--groups", default="1,2,4,8,16,32,64")
    ap.add_argument("--ranks", default="1,4,16")
    args = ap.parse_args(argv)
    groups = [1, 8] if args.quick else [int(x) for x in args.groups.split(",")]
    ranks = [1, 4] if args.quick else [int(x) for x in args.ranks.split(",")]
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 64 groups x 16 ranks of sockets
    rows = []
    for r in ranks:
        for g in groups:
            calls = max(20, (100 if args.quick else 400) // max(1, g * r // 8))
            row = measure(g, r, calls)
            rows.append(row)
            print(
                f"G={g} R={r}: p50 {row['p50_ms']:.2f} ms, controller "
                f"{row['ctrl_cpu_us_per_call']:.0f} us/call",
                file=sys.stderr,
                flush=True,
            )
    table = Table(title="one-to-all call: controller -> G coordinators -> R ranks each")
    for column in ("G", "R", "ranks", "p50 ms", "p99 ms", "ctrl CPU us/call", "us/group",
                   "msgs/call", "bytes/call", "coord CPU us/rank"):  # fmt: skip
        table.add_column(column, justify="right")
    for row in rows:
        g, r = row["groups"], row["ranks_per_group"]
        table.add_row(
            str(g), str(r), str(g * r), f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}",
            f"{row['ctrl_cpu_us_per_call']:.0f}", f"{row['ctrl_cpu_us_per_group']:.0f}",
            f"{row['ctrl_msgs_per_call']:.0f}", f"{row['ctrl_bytes_per_call']:.0f}",
            f"{row['coord_cpu_us_per_rank']:.0f}",
        )  # fmt: skip
    Console(stderr=True).print(table)
    print(json.dumps({"bench": "mesh_scale", "cores": os.cpu_count(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
