"""Supervision: a role group that dies is restarted under its restart policy and the run goes on.

The controller learns of a death within seconds (``controller/server.py``); without a policy
(``GroupSpec.restart`` None) the death fails every call to the group and the run stops, naming
role, rank and cause. With one, the ``Supervisor`` acts according to the kind of group:

* **Stateless groups** (reward functions and models, environments and tools, a separate rollout
  group: nothing training changed lives only there) are restarted on their own: after the
  policy's back-off the group's launcher starts it again (``Relaunch``; for a group started by
  hand, its process manager or operator does and the controller waits ``rejoin_s``), the
  controller waits for its hello and its roles' build, runs the group's restore hook (a rollout
  group gets the actor's current weights through reshard, ``RolloutPipeline``; a reward model
  reloads its weights from its path when built) and only then lets calls through again. Every
  call that failed on the death, or arrived meanwhile, is re-issued with its original
  arguments (``Controller.call``): generation requests carry their own sampling seeds, so a
  regenerated batch equals the one that was lost.
* **Stateful groups** (the actor, critics, the reference, any group hosting one of them) are
  not restarted under the calls: their deaths reach the program, and the run loop
  (``deploy/commands/run.py``) asks ``rollback`` to restart every stateful group together from the
  last complete checkpoint, then replays the steps since it with a new trainer in the same
  controller process. A deterministic run ends with the weights of an undisturbed one.

A policy allows ``max`` restarts within ``window_s``; one more ends the run as a death does
without a policy, and the error says which setting allowed how many. Each fault and each restart
is reported through ``on_event`` (the run's metrics file and live view): group, rank, cause,
seconds to recover, and (for a rollback) the steps replayed.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controller.placement import GroupSpec, RestartPolicy
from transport.errors import HybridflowError, RegistrationError

if TYPE_CHECKING:
    from controller.server import Controller

log = logging.getLogger("hybridflow.supervisor")

Relaunch = Callable[[GroupSpec], Awaitable[None]]  # end what is left of a group, start it again
Restore = Callable[[], Awaitable[None]]  # bring a restarted group's state back
Event = dict[str, Any]

#: the group whose restore hook the current task runs: its calls go through while other calls
#: to the group wait for the restore to finish
restoring: contextvars.ContextVar[str | None] = contextvars.ContextVar("restoring", default=None)


#: how long a failed call waits for the death that may explain it to be declared (a rank's peer
#: can report the broken link before the launcher reports the exit)
DEATH_GRACE_S = 3.0


class RestartRefused(HybridflowError):
    """A group died and its restart policy does not allow another restart (or it has none)."""


@dataclass
class _Watch:
    """One group's supervision state."""

    spec: GroupSpec
    restarts: deque[float] = field(default_factory=deque)  # monotonic times, within the window
    recovery: asyncio.Task[bool] | None = None
    died_at: float = 0.0

    @property
    def policy(self) -> RestartPolicy | None:
        return self.spec.restart

    def allowed(self, now: float) -> bool:
        policy = self.policy
        if policy is None or policy.max == 0:
            return False
        while self.restarts and now - self.restarts[0] > policy.window_s:
            self.restarts.popleft()
        return len(self.restarts) < policy.max

    def refusal(self) -> str:
        policy = self.policy
        name = self.spec.name
        if policy is None or policy.max == 0:
            return f"not restarted: placement.{name}.restart allows none"
        return (
            f"not restarted: {len(self.restarts)} restart(s) within {policy.window_s:.0f} s "
            f"already, the most placement.{name}.restart.max={policy.max} allows"
        )


class Supervisor:
    """Restarts dead groups under their policies for one controller (``controller.supervisor``).

    ``relaunch``: per group name, how its launcher starts it again (absent: a group started by
    hand, which the controller waits for). ``restore``: per group name, the hook that brings a
    restarted stateless group's state back (set by the program that knows it, e.g. the rollout
    pipeline). ``on_event``: where fault and restart records go."""

    def __init__(
        self,
        controller: Controller,
        relaunch: dict[str, Relaunch] | None = None,
        on_event: Callable[[Event], None] | None = None,
        announce: Callable[[GroupSpec], None] | None = None,
    ) -> None:
        self.controller = controller
        self.relaunch = dict(relaunch or {})
        self.on_event = on_event
        self.announce = announce  # says how to restart a group started by hand
        self.restore: dict[str, Restore] = {}
        self.watch = {name: _Watch(g.spec) for name, g in controller.groups.items()}
        self.events: list[Event] = []
        self.closing = False
        self.armed = False  # set once every group is up (``Controller.wait_ready``)
        self._death = asyncio.Event()  # set at each death (``death``)
        controller.supervisor = self

    # -- deaths (called by the controller, synchronously, as it settles one) -------------------

    def died(self, name: str, rank: int | None, cause: str) -> str | None:
        """A group was declared dead. Starts a stateless group's recovery when its policy allows;
        returns what to add to the death's cause when the group will not be restarted."""
        watch = self.watch[name]
        if self.closing or not self.armed:
            return None  # the shutdown's exits; or a start that failed, which stops the run
        watch.died_at = time.monotonic()
        self._death.set()
        self._event("fault", name, rank=rank, cause=cause)
        if watch.spec.stateful:
            if watch.allowed(time.monotonic()):
                return None  # the run loop rolls back (``rollback``)
            return watch.refusal()
        if watch.recovery is not None and not watch.recovery.done():
            return None  # it died while restarting: the recovery in progress sees it
        if not watch.allowed(time.monotonic()):
            watch.recovery = None  # an earlier recovery's success says nothing of this death
            return watch.refusal()
        watch.recovery = asyncio.ensure_future(self._recover(watch))
        return None

    # -- stateless groups -----------------------------------------------------------------------

    async def _recover(self, watch: _Watch) -> bool:
        """Restart one stateless group until it serves again or its policy runs out."""
        name = watch.spec.name
        began = watch.died_at
        tries = 0
        while True:
            now = time.monotonic()
            if not watch.allowed(now):
                self._give_up(watch)
                return False
            wait_s = watch.policy.backoff(len(watch.restarts)) if watch.policy else 0.0
            watch.restarts.append(now)
            tries += 1
            if wait_s:
                await asyncio.sleep(wait_s)  # the policy's back-off, not a synchronisation
            try:
                await self._start_again(watch.spec)
                hook = self.restore.get(name)
                if hook is not None:
                    token = restoring.set(name)
                    try:
                        await hook()
                    finally:
                        restoring.reset(token)
            except Exception as exc:  # died again while starting or restoring: try again
                log.warning("restarting group %r failed (try %d): %s", name, tries, exc)
                group = self.controller.groups[name]
                if group.dead is None:
                    self.controller.declare_dead(name, None, f"restart failed: {exc}", True)
                continue
            seconds = time.monotonic() - began
            self._event("restart", name, recover_s=round(seconds, 3), tries=tries)
            log.warning("group %r restarted in %.1f s (try %d)", name, seconds, tries)
            return True

    def _give_up(self, watch: _Watch) -> None:
        group = self.controller.groups[watch.spec.name]
        if group.dead is not None and "not restarted" not in group.dead[1]:
            group.dead = (group.dead[0], f"{group.dead[1]}; {watch.refusal()}")

    async def _start_again(self, spec: GroupSpec) -> None:
        """Forget the group's old incarnation, have its launcher start it (or wait for its
        operator), wait for its hello and build; raises when it dies or does not come back."""
        self.controller.reset(spec.name)
        relaunch = self.relaunch.get(spec.name)
        if relaunch is not None:
            await relaunch(spec)
        elif self.announce is not None:
            self.announce(spec)
        policy = spec.restart or RestartPolicy()
        group = self.controller.groups[spec.name]
        try:
            async with asyncio.timeout(policy.rejoin_s):
                await group.ready.wait()
        except TimeoutError:
            raise RegistrationError(
                f"group {spec.name!r} did not register again within {policy.rejoin_s:.0f} s "
                f"(raise placement.{spec.name}.restart.rejoin_s)"
            ) from None
        if group.dead is not None:
            rank, cause = group.dead
            where = "" if rank is None else f"rank {rank} "
            raise RegistrationError(f"group {spec.name!r} died while starting: {where}{cause}")

    async def recovered(self, name: str) -> bool:
        """Wait for the recovery of a dead stateless group; True when it serves again (calls
        that failed on its death may be re-issued), False when it will not be restarted."""
        watch = self.watch[name]
        if watch.recovery is None:
            return False
        return await asyncio.shield(watch.recovery)

    async def serving(self, name: str) -> None:
        """Wait while the group is being restarted (its restore hook's own calls go through)."""
        watch = self.watch[name]
        if watch.recovery is None or watch.recovery.done() or restoring.get() == name:
            return
        await asyncio.shield(watch.recovery)

    # -- stateful groups ------------------------------------------------------------------------

    async def death(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the next death to be declared."""
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                await self._death.wait()
        except TimeoutError:
            pass
        self._death.clear()

    def restarts_stateful(self) -> bool:
        """Whether any stateful group has a restart policy (a rollback is possible at all)."""
        return any(w.spec.stateful and w.policy for w in self.watch.values())

    async def stateful_fault(
        self, grace_s: float = DEATH_GRACE_S
    ) -> tuple[str, int | None, str] | None:
        """After a call failed: the dead stateful group a rollback would answer (``rollback_cause``),
        waiting up to ``grace_s`` for a death that may explain the failure to be declared; None
        when no stateful group may be restarted or none died."""
        if not self.restarts_stateful():
            return None
        fault = self.rollback_cause()
        deadline = time.monotonic() + grace_s
        while fault is None and time.monotonic() < deadline:
            await self.death(deadline - time.monotonic())
            fault = self.rollback_cause()
        return fault

    def rollback_cause(self) -> tuple[str, int | None, str] | None:
        """The dead stateful group a rollback would answer, with its rank and cause (None: no
        stateful group is dead, or the dead one's policy refuses; its death then stops the run)."""
        for name, group in self.controller.groups.items():
            watch = self.watch[name]
            if group.dead is not None and watch.spec.stateful:
                if not watch.allowed(time.monotonic()):
                    return None
                return name, group.dead[0], group.dead[1]
        return None

    async def rollback(self, fault: tuple[str, int | None, str], steps_replayed: int) -> float:
        """Restart every stateful group (the dead one counts against its policy), concurrently;
        returns the seconds since the death. The caller resumes from the last checkpoint."""
        name = fault[0]
        watch = self.watch[name]
        now = time.monotonic()
        wait_s = watch.policy.backoff(len(watch.restarts)) if watch.policy else 0.0
        watch.restarts.append(now)
        began = watch.died_at or now
        if wait_s:
            await asyncio.sleep(wait_s)  # the policy's back-off, not a synchronisation
        stateful = [w.spec for w in self.watch.values() if w.spec.stateful]
        tries = 1
        while True:
            try:
                await asyncio.gather(*(self._start_again(spec) for spec in stateful))
                break
            except Exception as exc:  # a start that failed (a lost node's share not yet
                now = time.monotonic()  # placed, a rank dead at once) is one more fault
                if not watch.allowed(now):
                    raise RegistrationError(
                        f"group {name!r} did not start again ({exc}); {watch.refusal()}"
                    ) from exc
                log.warning("restarting the stateful groups failed (try %d): %s", tries, exc)
                wait_s = watch.policy.backoff(len(watch.restarts)) if watch.policy else 0.0
                watch.restarts.append(now)
                tries += 1
                if wait_s:
                    await asyncio.sleep(wait_s)  # the policy's back-off
        seconds = time.monotonic() - began
        self._event(
            "rollback",
            name,
            rank=fault[1],
            cause=fault[2],
            recover_s=round(seconds, 3),
            steps_replayed=steps_replayed,
            groups=[s.name for s in stateful],
        )
        return seconds

    def close(self) -> None:
        """The run is over: deaths from here on are the shutdown's; recoveries stop."""
        self.closing = True
        for watch in self.watch.values():
            if watch.recovery is not None and not watch.recovery.done():
                watch.recovery.cancel()

    # -- records --------------------------------------------------------------------------------

    def _event(self, kind: str, group: str, **values: Any) -> None:
        record: Event = {"event": kind, "group": group, "time": round(time.time(), 3), **values}
        self.events.append(record)
        if self.on_event is not None:
            try:
                self.on_event(record)
            except Exception:  # a sink's failure must not stop a recovery
                log.exception("recording %s of group %r failed", kind, group)

    def summary(self) -> dict[str, Any]:
        """Faults and restarts of the run so far, for ``summary.json``."""
        faults = [e for e in self.events if e["event"] == "fault"]
        recovered = [e for e in self.events if e["event"] in ("restart", "rollback")]
        return {
            "faults": len(faults),
            "restarts": len([e for e in recovered if e["event"] == "restart"]),
            "rollbacks": len([e for e in recovered if e["event"] == "rollback"]),
            "steps_replayed": sum(int(e.get("steps_replayed", 0)) for e in recovered),
            "recover_s_max": max((float(e["recover_s"]) for e in recovered), default=0.0),
        }
