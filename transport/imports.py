"""User code named by import path (``package.module:name``): a role class, a tool, a reward
function, a policy loss. Resolved where it runs, and also where a config naming it is made, so a
typo fails before any process starts."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_path(path: str, what: str, kind: str, check: Callable[[Any], bool]) -> Any:
    """``package.module:name`` → the object, or a ValueError saying what is wrong; ``what``
    names the setting (``role class``), ``kind`` the object (``class``), ``check`` accepts it."""
    module_name, sep, attr = path.partition(":")
    if not (sep and module_name and attr):
        raise ValueError(f"{what} {path!r} must look like package.module:{kind}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} for {what} {path!r}: {exc}") from exc
    found = getattr(module, attr, None)
    if not check(found):
        raise ValueError(f"{module_name} has no {kind} {attr!r} ({what} {path!r})")
    return found
