"""How a tool says that it failed, and how the failure is counted.

Anything a tool raises becomes an observation the model sees (``error="raised"``). A tool that
knows better raises a ``ToolFailure`` whose ``kind`` names the failure as the rollout's metrics
count it (``tools/errors/<kind>``); its message is the text the model sees.
"""

from __future__ import annotations

from transport.agent import ErrorKind


class ToolFailure(Exception):
    """A tool failed; the message is what the model sees."""

    kind: ErrorKind = "raised"


class ToolTimeout(ToolFailure):
    """The tool's work ran past its own time limit and was stopped."""

    kind: ErrorKind = "timeout"


class SandboxKilled(ToolFailure):
    """The sandboxed process was killed by one of its limits (memory, CPU time, file size)."""

    kind: ErrorKind = "sandbox_killed"


class SandboxUnavailable(ToolFailure):
    """The kernel here cannot isolate the code and the weak mode was not chosen."""

    kind: ErrorKind = "sandbox_killed"
