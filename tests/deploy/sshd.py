"""A private OpenSSH server for tests: root logs in with a fresh key on ADDRESS:2222, as on a
remote host; ``prefix`` runs it elsewhere (a network namespace, a UTS namespace)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import require_system

PORT = 2222


@contextmanager
def sshd(
    folder: Path, address: str, prefix: list[str] | None = None, hostname: str | None = None
) -> Iterator[list[str]]:
    """Yields the ssh command (key, port, no host-key prompts) that logs in as root."""
    require_system("OpenSSH", shutil.which("sshd") is not None, "apt-get install openssh-server")
    folder.mkdir()
    for key in ("host", "id"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / key)], check=True
        )
    shutil.copy(folder / "id.pub", folder / "authorized_keys")
    config = folder / "sshd_config"
    config.write_text(
        f"Port {PORT}\nListenAddress {address}\nHostKey {folder / 'host'}\n"
        f"AuthorizedKeysFile {folder / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nStrictModes no\n"
        f"UsePAM no\nPidFile {folder / 'sshd.pid'}\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege-separation directory
    line = f"exec /usr/sbin/sshd -D -f {config} -E {folder / 'log'}"
    if hostname is not None:
        line = f"hostname {hostname} && {line}"
    server = subprocess.Popen([*(prefix or []), "sh", "-c", line])
    deadline = time.monotonic() + 10
    while not (folder / "sshd.pid").exists():  # written once it listens
        assert server.poll() is None and time.monotonic() < deadline, (folder / "log").read_text()
        time.sleep(0.05)
    options = ["BatchMode=yes", "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null"]
    try:
        yield [
            "ssh",
            *("-i", str(folder / "id"), "-p", str(PORT)),
            *(x for o in [*options, "LogLevel=ERROR"] for x in ("-o", o)),
            f"root@{address}",
        ]
    finally:
        server.terminate()
        server.wait(timeout=10)
