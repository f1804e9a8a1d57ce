"""``hybridflow serve --base-model DIR``: the Tinker REST API on this machine, so that the
``tinker`` SDK (and every script and cookbook recipe written for it) trains and samples with
hybridflow: ``TINKER_BASE_URL=http://127.0.0.1:PORT TINKER_API_KEY=KEY python recipe.py``.

Each training client the SDK makes is a LoRA actor of a mesh of its own (``deploy/tinker/``),
on this machine's cores; ``--set`` overrides go into each model's experiment (e.g.
``roles.actor.dtype=fp32``). The key is the one given or a new one, printed once. The server
binds the loopback interface unless ``--host`` says otherwise, which it refuses without a key
given (put it behind TLS: the SDK sends the key in a header). SIGINT or SIGTERM stops every
group.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
LOOPBACK = ("127.0.0.1", "::1", "localhost")
#: how often sessions are checked for heartbeats
SWEEP_S = 10.0


@dataclass(frozen=True)
class ServeOptions:
    """``hybridflow serve``'s options, typed."""

    bases: tuple[tuple[str, Path], ...]  # (the name clients ask for, the folder)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    run_dir: Path | None = None
    nproc: int = 1
    max_models: int = 2
    session_idle_s: float = 120.0
    resume: bool = False
    overrides: tuple[str, ...] = ()
    clusters: Path | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        return cls(
            bases=tuple(args.base_model),
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            run_dir=args.run_dir,
            nproc=args.nproc,
            max_models=args.max_models,
            session_idle_s=args.session_idle_s,
            resume=args.resume,
            overrides=tuple(args.set),
            clusters=args.clusters,
        )


def base_model_arg(text: str) -> tuple[str, Path]:
    """``--base-model``'s value: ``NAME=DIR``, or a folder (named by its last part)."""
    name, sep, folder = text.partition("=")
    if sep and name and folder and not Path(text).is_dir():
        return name, Path(folder)
    return Path(text).name, Path(text)


def add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    what = "serve the Tinker REST API: the tinker SDK's clients train and sample here"
    p = subparsers.add_parser("serve", help=what, description=what)
    p.add_argument(
        "--base-model",
        type=base_model_arg,
        action="append",
        required=True,
        metavar="[NAME=]DIR",
        help="a Hugging Face model folder clients may train, by its folder's name or by NAME "
        "(e.g. Qwen/Qwen3-0.6B=/models/qwen3: the name recipes look their renderer up by); "
        "repeat for several",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free one)")
    p.add_argument("--api-key", help="the key clients send (tml-...); default: a new one, printed")
    p.add_argument("--run-dir", type=Path, help="folder of the models' runs and checkpoints")
    p.add_argument(
        "--resume",
        action="store_true",
        help="serve the checkpoints an earlier server saved in --run-dir again (its clients "
        "are not restarted: load their saved states into new ones)",
    )
    p.add_argument("--nproc", type=int, default=1, help="ranks of each training client's group")
    p.add_argument(
        "--max-models", type=int, default=2, help="training clients at once; more are refused"
    )
    p.add_argument(
        "--session-idle-s",
        type=float,
        default=120.0,
        help="a session without a heartbeat for this long is finished, its models stopped "
        "(the SDK sends one every 10 s)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override of each model's experiment, e.g. roles.actor.dtype=fp32",
    )
    p.add_argument(
        "--clusters",
        type=Path,
        metavar="SPEC",
        help="cluster spec YAML (as hybridflow run takes): where each training client's group "
        "starts (its group is 'main': actor and reward; bind the controller to port 0)",
    )
    p.set_defaults(fn=serve_command)


def read_url(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The ``TINKER_BASE_URL=`` line a ``hybridflow serve`` started with its output on a pipe
    prints once it listens (for scripts and tests that start one on ``--port 0``)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    seen = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while time.monotonic() < deadline and sel.select(deadline - time.monotonic()):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            seen += chunk
            for line in seen.decode(errors="replace").splitlines():
                if line.startswith("TINKER_BASE_URL="):
                    return line.split("=", 1)[1].strip()
    raise TimeoutError(
        f"hybridflow serve printed no URL within {timeout_s:g} s (exit status "
        f"{proc.poll()}): {seen.decode(errors='replace')[-2000:]}"
    )


def serve_command(args: argparse.Namespace) -> int:
    from deploy.terminal import run_async

    opts = ServeOptions.from_args(args)
    check(opts)
    return int(run_async(lambda: serve(opts)))


def check(opts: ServeOptions) -> None:
    """Refuse before anything starts: a base model that is not a folder, a key without the
    SDK's prefix, another address than loopback without a key of the user's."""
    for name, base in opts.bases:
        if not (base / "config.json").is_file():
            raise SystemExit(
                f"--base-model {name}={base}: not a Hugging Face model folder (config.json)"
            )
    names = [name for name, _ in opts.bases]
    if len(set(names)) != len(names):
        raise SystemExit(f"--base-model: two models have one name ({names}); names must differ")
    if opts.api_key is not None and not opts.api_key.startswith("tml-"):
        raise SystemExit("--api-key: the tinker SDK sends only keys that start with 'tml-'")
    if opts.host not in LOOPBACK and opts.api_key is None:
        raise SystemExit(
            f"--host {opts.host}: another address than loopback needs --api-key of your own "
            "(and TLS in front: the key travels in a header)"
        )
    if opts.resume and opts.run_dir is None:
        raise SystemExit("--resume needs --run-dir: the folder of the server to resume")
    if opts.nproc < 1 or opts.max_models < 1:
        raise SystemExit("--nproc and --max-models must be >= 1")


async def serve(opts: ServeOptions) -> int:
    from aiohttp import web

    from deploy.experiment import ExperimentError
    from deploy.tinker.app import make_app
    from deploy.tinker.service import Served, Service

    key = opts.api_key or f"tml-{secrets.token_urlsafe(24)}"
    run_dir = opts.run_dir or Path("runs") / f"serve-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    bases = [Served(name, base.resolve()) for name, base in opts.bases]
    service = Service(
        bases, run_dir.resolve(), opts.nproc, opts.max_models, opts.overrides, opts.clusters
    )
    try:
        service.check()
    except ExperimentError as exc:
        print(f"hybridflow serve: {exc}", file=sys.stderr)
        return 2
    if opts.resume:
        print(f"resumed {service.resume()} training clients' checkpoints from {run_dir}")
    runner = web.AppRunner(make_app(service, key), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, opts.host, opts.port)
    await site.start()
    port = runner.addresses[0][1]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    where = f"http://{opts.host}:{port}"
    print(f"serving the Tinker API at {where} (models: {', '.join(b.name for b in bases)})")
    if opts.api_key is None:
        print(f"TINKER_API_KEY={key}")
    print(f"TINKER_BASE_URL={where}", flush=True)
    sys.stdout.flush()

    async def sweep() -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            await service.sweep(opts.session_idle_s)

    sweeper = asyncio.ensure_future(sweep())
    try:
        await stop.wait()
    finally:
        sweeper.cancel()
        await runner.cleanup()
        await service.close()
    return 0
