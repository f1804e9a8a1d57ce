"""What every ``hybridflow`` command shares with the terminal: the stderr console and the event loop.

``console`` writes progress and errors to stderr, so a command's ``--json`` output on stdout
stays one line. ``run_async`` runs a command's async main on uvloop (when installed) and turns
SIGINT/SIGTERM into cancelling it, so sessions tear their processes down in order. They live
here, apart from ``deploy/cli.py``, because the command modules (``deploy/commands/``)
need them and ``cli.py`` needs the command modules.

When stderr is not a terminal (``nohup``, SLURM, CI, a pipe) output is for grep and log parsers:
the console never wraps a line (rich would wrap at 80 columns there), so one record is one line,
and library progress bars (transformers' and huggingface_hub's, drawn with carriage returns) are
off in this process and the processes it starts (``quiet_library_progress``). On a terminal the
live view turns them off while it draws (``deploy/reports/live.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rich.console import Console

from transport.device import DeviceKind

T = TypeVar("T")

#: progress bars of huggingface_hub, and of transformers, which follows it; read when they are
#: imported, so the processes this one starts inherit it
PROGRESS_BARS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"


def quiet_library_progress() -> None:
    """Turn library progress bars off here and in the processes started from now on."""
    os.environ[PROGRESS_BARS_ENV] = "1"
    if "transformers" in sys.modules:  # imported already: it read the variable then
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


_plain = not sys.stderr.isatty()
console = Console(stderr=True, soft_wrap=_plain)
if _plain:
    quiet_library_progress()


def _event_loop_runner() -> Callable[..., Any]:
    """uvloop's ``run`` when it is installed (an optional speed-up), else ``asyncio.run``."""
    try:
        import uvloop  # optional: not installed on every platform
    except ImportError:
        return asyncio.run
    return uvloop.run


def run_async(main: Callable[[], Awaitable[T]], interrupt: Callable[[], bool] | None = None) -> T:
    """Run ``main`` on uvloop (when installed) with SIGINT/SIGTERM cancelling it cleanly. With
    ``interrupt``, the first SIGINT calls it instead, and cancels only if it returns False (it
    could not take the request: nothing to finish gracefully); a second SIGINT cancels."""

    async def guarded() -> T:
        task = asyncio.ensure_future(main())
        loop = asyncio.get_running_loop()
        asked = False

        def on_sigint() -> None:
            nonlocal asked
            first, asked = not asked, True
            if not (first and interrupt is not None and interrupt()):
                task.cancel()

        loop.add_signal_handler(signal.SIGINT, on_sigint)
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        return await task

    result: T = _event_loop_runner()(guarded())
    return result


def add_device_option(parser: argparse.ArgumentParser, help: str) -> None:
    """``--device cpu|cuda`` (default cpu): where a command's ranks or engines compute."""
    parser.add_argument(
        "--device", choices=[k.value for k in DeviceKind], default=DeviceKind.CPU.value, help=help
    )
