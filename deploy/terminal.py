"""What every ``hybridflow`` command shares with the terminal: the stderr console and the event loop.

``console`` writes progress and errors to stderr, so a command's ``--json`` output on stdout
stays one line. ``run_async`` runs a command's async main on uvloop (when installed) and turns
SIGINT/SIGTERM into cancelling it, so sessions tear their processes down in order. They live
here, apart from ``deploy/cli.py``, because the command modules (``run_cli``, ``train_cli``, ...)
need them and ``cli.py`` needs the command modules.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rich.console import Console

from transport.device import DeviceKind

T = TypeVar("T")

console = Console(stderr=True)


def _event_loop_runner() -> Callable[..., Any]:
    """uvloop's ``run`` when it is installed (an optional speed-up), else ``asyncio.run``."""
    try:
        import uvloop  # optional: not installed on every platform
    except ImportError:
        return asyncio.run
    return uvloop.run


def run_async(main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main`` on uvloop (when installed) with SIGINT/SIGTERM cancelling it cleanly."""

    async def guarded() -> T:
        task = asyncio.ensure_future(main())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        return await task

    result: T = _event_loop_runner()(guarded())
    return result


def add_device_option(parser: argparse.ArgumentParser, help: str) -> None:
    """``--device cpu|cuda`` (default cpu): where a command's ranks or engines compute."""
    parser.add_argument(
        "--device", choices=[k.value for k in DeviceKind], default=DeviceKind.CPU.value, help=help
    )
