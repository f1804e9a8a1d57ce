"""Errors a controller program sees when a role call does not return normally."""

from __future__ import annotations

from transport.batch import BatchError


class HybridflowError(RuntimeError):
    """Base class of hybridflow's runtime errors."""


class RemoteError(HybridflowError):
    """A role method raised on some rank; the group is still usable. Its message names the role,
    the rank, the exception and the frame that raised it (a user's reward function or loss:
    their own line); the whole remote traceback is ``remote_traceback``."""

    def __init__(self, role: str, rank: int, exc_type: str, message: str, traceback: str) -> None:
        self.role = role
        self.rank = rank
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = traceback
        where = innermost_frame(traceback)
        super().__init__(
            f"{role} rank {rank} raised {exc_type}: {message}"
            + (f"\n  at {where}" if where else "")
            + "\n  (the remote traceback: .remote_traceback)"
        )


class RemoteEngineError(RemoteError):
    """A training engine refused or failed a call on a rank (``EngineError``: e.g. an optimizer
    step with no gradients, gradients pending before a whole step)."""


class RemoteGenerationError(RemoteError):
    """A generation engine refused or failed a call on a rank (``GenerationError``)."""


class RemoteBatchError(RemoteError, BatchError):
    """A rank found a batch unusable (``BatchError``: a column missing or misshapen); caught by
    ``except BatchError`` as the same check made before sending is."""


class RemoteRewardError(RemoteError):
    """A reward function (user code) raised, or returned no score, on a rank (``RewardError``)."""


#: a rank's exception type, by name, to the class the caller gets (anything else: RemoteError)
REMOTE_TYPES: dict[str, type[RemoteError]] = {
    "EngineError": RemoteEngineError,
    "GenerationError": RemoteGenerationError,
    "BatchError": RemoteBatchError,
    "RewardError": RemoteRewardError,
}


def remote_error(role: str, rank: int, exc_type: str, message: str, traceback: str) -> RemoteError:
    """The error a rank's ERROR reply becomes: a subclass naming its kind where there is one."""
    return REMOTE_TYPES.get(exc_type, RemoteError)(role, rank, exc_type, message, traceback)


def innermost_frame(traceback: str) -> str:
    """``file:line in function: code`` of the last frame of a formatted traceback ('' if none)."""
    lines = traceback.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        head = lines[i].strip()
        if head.startswith('File "') and ", line " in head:
            path, _, rest = head[len('File "') :].partition('", line ')
            number, _, function = rest.partition(", in ")
            after = lines[i + 1] if i + 1 < len(lines) else ""
            code = after.strip() if after.startswith("    ") else ""  # no source: none shown
            code = "" if code.startswith(("^", "~")) else code
            return f"{path}:{number} in {function}" + (f": {code}" if code else "")
    return ""


class RoleDeadError(HybridflowError):
    """A role's process group lost a process; sticky: every later call raises it too."""

    def __init__(self, role: str, rank: int | None, cause: str) -> None:
        self.role = role
        self.rank = rank
        self.cause = cause
        where = f"rank {rank}" if rank is not None else "a rank"
        super().__init__(f"role {role!r} is dead: {where} {cause}")


class CallTimeoutError(HybridflowError, TimeoutError):
    """A call took longer than its timeout."""


class RegistrationError(HybridflowError):
    """A group could not join the controller (refused, or never came)."""
