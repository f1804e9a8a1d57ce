"""Authentication: a shared token on local links, ZeroMQ CURVE on TCP that leaves the host.

CURVE is set per socket. The controller's TCP ROUTER is a CURVE server that accepts only client
public keys listed in a directory (a ZAP handler from pyzmq checks each handshake); coordinators
are CURVE clients that pin the controller's public key, so both sides are authenticated and the
link is encrypted. Keys are the ZeroMQ certificate files written by ``zmq.auth``
(``NAME.key`` public, ``NAME.key_secret`` secret); ``hybridflow keys`` makes them.

Local links (ipc, loopback) rely on file permissions plus a random per-run token in the hello,
compared in constant time.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ZAP_DOMAIN = "hybridflow"


def new_token() -> str:
    return secrets.token_hex(16)


def token_ok(expected: str, given: Any) -> bool:
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


def make_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` into ``directory``; returns both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def load_keypair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file."""
    if not path.is_file():
        raise FileNotFoundError(f"no CURVE secret key file at {path} (make one: hybridflow keys)")
    public, secret = zmq.auth.load_certificate(str(path))
    if secret is None:
        raise ValueError(f"{path} holds no secret key; pass the .key_secret file")
    return public, secret


def load_public(path: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(f"no CURVE public key file at {path}")
    public, _ = zmq.auth.load_certificate(str(path))
    return public


@dataclass
class CurveServer:
    """The controller side: its own key pair and a directory of accepted client public keys."""

    secret_file: Path
    allowed_dir: Path

    def apply(self, sock: zmq.Socket[Any]) -> None:
        public, secret = load_keypair(self.secret_file)
        sock.curve_server = True
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.zap_domain = ZAP_DOMAIN.encode()

    def start_authenticator(self, ctx: zmq.Context[Any]) -> ThreadAuthenticator:
        """Runs until stopped; refuses every client whose key is not in ``allowed_dir``."""
        if not self.allowed_dir.is_dir():
            raise FileNotFoundError(f"allowed client key directory {self.allowed_dir} is missing")
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain=ZAP_DOMAIN, location=str(self.allowed_dir))
        return auth


@dataclass
class CurveClient:
    """A coordinator's side: its key pair and the controller's public key it insists on."""

    secret_file: Path
    server_public_file: Path

    def apply(self, sock: zmq.Socket[Any]) -> None:
        public, secret = load_keypair(self.secret_file)
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = load_public(self.server_public_file)
