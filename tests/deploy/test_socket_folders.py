"""Issue 21, 2d: a session's ipc socket folder does not outlive a controller killed with -9.

The owner holds a lock on the folder that the kernel drops when it dies; the next session's
sweep removes exactly such orphans and leaves live sessions' folders alone."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.launchers.local import SocketFolder, sweep_socket_folders
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
SESSION = """
import asyncio
from deploy.session import local_session
from tests.conftest import TEST_TIMEOUTS, group

async def main() -> None:
    async with local_session([group("g", 1, echo="tests.fixtures.roles:Echo")], TEST_TIMEOUTS) as c:
        print(c.addresses[0], flush=True)
        await asyncio.sleep(120)

asyncio.run(main())
"""


@pytest.fixture
def root() -> Iterator[Path]:
    """A short private temp dir (ipc paths are limited to ~100 bytes) standing in for /tmp."""
    path = Path(tempfile.mkdtemp(prefix="hf21-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def killed_session(root: Path) -> Path:
    """Start a live session with TMPDIR=root, kill -9 its controller; its socket folder."""
    env = {**os.environ, "TMPDIR": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SESSION], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()  # printed once the group joined
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert address.startswith(f"ipc://{root}/hf-"), address
    return Path(address.removeprefix("ipc://")).parent


def test_the_next_session_removes_the_folder_of_a_killed_one(root: Path) -> None:
    first = killed_session(root)
    assert first.is_dir()  # kill -9 runs no cleanup
    second = killed_session(root)  # its start swept the first
    assert not first.exists()
    # the second's fork server (hf-fork-*) sees its launcher gone and removes its own folder;
    # (torch's import may add its torchinductor_* cache folder to TMPDIR: not a session's)
    wait_for(lambda: sorted(root.glob("hf-*")) == [second], 60, "only the second's folder left",
             detail=lambda: sorted(root.iterdir()))  # fmt: skip


def test_live_folders_are_kept_and_unlocked_ones_not_judged(root: Path) -> None:
    live = SocketFolder(root)
    (root / "hf-old").mkdir()  # an older version's folder, or one being made
    assert sweep_socket_folders(root) == []
    assert live.path.is_dir() and (root / "hf-old").is_dir()
    live.remove()
    assert not live.path.exists()
