"""``hybridflow keys DIR --clients main,gen``: ZeroMQ CURVE key pairs for links that leave a host.

Layout of DIR (the controller's host keeps ``controller.key_secret`` and ``allowed/``; each
group's host gets its own ``NAME.key_secret`` and the controller's public ``controller.key``):

    DIR/controller.key         the controller's public key (coordinators pin it)
    DIR/controller.key_secret  the controller's key pair (mode 600)
    DIR/NAME.key_secret        one pair per client (a process group, or a cluster's groups)
    DIR/NAME.key
    DIR/allowed/NAME.key       the public keys the controller accepts: remove one to revoke it

``hybridflow controller ... --keys DIR`` and ``hybridflow role ... --keys DIR --client NAME``
use them; a client whose key is not in ``allowed/`` is refused during the handshake.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from transport.security import make_keypair

CONTROLLER = "controller"


def add_keys_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("keys", help="make CURVE key pairs for TCP links between hosts")
    p.add_argument("dir", type=Path, help="folder the key pairs are written to")
    p.add_argument(
        "--clients", default="", help="comma-separated client names (e.g. the group names)"
    )
    p.set_defaults(fn=keys_command)


def keys_command(args: argparse.Namespace) -> int:
    return make_keys(args.dir, [n for n in args.clients.split(",") if n])


def make_keys(folder: Path, names: list[str]) -> int:
    """The controller's key pair and one per client in ``folder`` (existing pairs are kept),
    each client's public key accepted; 2 when a client takes the controller's name."""
    if CONTROLLER in names:
        print(f"hybridflow keys: {CONTROLLER!r} is the controller's own name", file=sys.stderr)
        return 2
    if not (folder / f"{CONTROLLER}.key_secret").exists():
        make_keypair(folder, CONTROLLER)
    allowed = folder / "allowed"
    allowed.mkdir(parents=True, exist_ok=True)
    for name in names:
        if not (folder / f"{name}.key_secret").exists():
            public, _ = make_keypair(folder, name)
            shutil.copy(public, allowed / public.name)
    print(f"{folder}: controller and {len(names)} client key pair(s); accepted: {allowed}")
    return 0


def server_files(keys: Path) -> tuple[Path, Path]:
    return keys / f"{CONTROLLER}.key_secret", keys / "allowed"


def client_files(keys: Path, client: str) -> tuple[Path, Path]:
    return keys / f"{client}.key_secret", keys / f"{CONTROLLER}.key"
