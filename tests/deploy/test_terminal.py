"""``run_async``'s signals, with real SIGINTs to this process: the first Ctrl-C goes to the
command's graceful stop when it can take it, a second one (or one it cannot take) cancels."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from deploy.terminal import run_async


def test_the_first_ctrl_c_asks_for_a_graceful_stop_and_the_second_cancels() -> None:
    asked: list[str] = []
    taken = asyncio.Event()

    def interrupt() -> bool:
        asked.append("graceful")
        taken.set()
        return True

    async def main() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(taken.wait(), 10)  # the first press reached the command
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.Event().wait()  # only a cancel ends this

    with pytest.raises(asyncio.CancelledError):
        run_async(main, interrupt)
    assert asked == ["graceful"]


def test_a_ctrl_c_the_command_cannot_take_cancels_at_once() -> None:
    async def main() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.Event().wait()

    with pytest.raises(asyncio.CancelledError):
        run_async(main, lambda: False)
