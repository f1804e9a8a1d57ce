"""Errors a controller program sees when a role call does not return normally."""

from __future__ import annotations


class HybridflowError(RuntimeError):
    """Base class of hybridflow's runtime errors."""


class RemoteError(HybridflowError):
    """A role method raised on some rank; the group is still usable."""

    def __init__(self, role: str, rank: int, exc_type: str, message: str, traceback: str) -> None:
        self.role = role
        self.rank = rank
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = traceback
        super().__init__(
            f"{role} rank {rank} raised {exc_type}: {message}\n--- remote traceback ---\n{traceback}"
        )


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
