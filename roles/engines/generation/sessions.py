"""Sessions: a trajectory's KV cache kept by the generator between its turns.

A multi-turn rollout asks for every turn with the whole trajectory so far as the prompt (the
controller holds the ids; ``controller/agent.py``) and names the trajectory as the request's
session. The native engine keeps, per session, the keys and values of the tokens it has already
run (``Session``: the prompt and the sampled tokens of the last turn, all but the last sampled
one, which was never fed back). The next turn's prompt starts with those ids and continues with
the turn's observation: only the tokens after the longest common prefix are prefilled, attending
to the kept keys and values.

Correctness never depends on the cache: a request always carries its whole prompt, the kept
prefix is used only as far as it matches it, and a session that is missing (never seen, dropped,
evicted under ``max_bytes``, or computed with other weights) is prefilled from the ids. A weight
change makes every kept session stale: its keys and values were computed by the old weights.
Sessions record the weight version they were computed at and are used only at that version. In
a run a weight update never meets a live session: the multi-turn rollout drops a batch's sessions
when the batch ends, and a batch's trajectories all sample from one version (a push waits for
the batch in flight); the version check guards any other caller. Keeping the old weights' KV
under new weights (an approximation some systems accept for speed) is not offered.

The kept keys and values are what decode computed for the sampled tokens: one token at a time,
not in one packed pass as a re-prefill would. The numbers agree to float rounding (the matrix
products run with other shapes), so the sampled tokens equal those of a full re-prefill unless a
draw falls within rounding of a boundary, and the log-probs agree to rounding (tested).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

#: a session cache's default bound (``session_cache_mb`` of the rollout role and the actor)
DEFAULT_SESSION_CACHE_MB = 512.0


@dataclass
class Session:
    """The keys and values of ``ids`` at every layer, ``[kv_heads, len(ids), head_dim]`` each,
    computed by the weights of ``version``."""

    ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    version: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class SessionStats:
    """What the cache did since the last ``take_stats``: positions a call prefilled, positions
    it took from kept sessions instead, sessions found, missed and evicted."""

    prefilled: int = 0
    reused: int = 0
    hits: int = 0
    misses: int = 0
    evicted: int = 0
    stale: int = 0

    def as_meta(self) -> dict[str, int]:
        return {f"session_{k}": v for k, v in vars(self).items()}


@dataclass
class SessionCache:
    """The sessions a generator keeps, least recently used first; at most ``max_bytes`` of keys
    and values (0: sessions off)."""

    max_bytes: int
    held: OrderedDict[Hashable, Session] = field(default_factory=OrderedDict)
    stats: SessionStats = field(default_factory=SessionStats)
    nbytes: int = 0

    def take(
        self, key: Hashable, prompt: Sequence[int], version: int
    ) -> tuple[Session | None, int]:
        """The session ``key`` (removed; ``put`` it back with its new state) and how many of
        ``prompt``'s first tokens it holds: the common prefix, at most all but the prompt's last
        token (whose logits the call needs)."""
        found = self.held.pop(key, None)
        if found is None:
            self.stats.misses += 1
            return None, 0
        self.nbytes -= found.nbytes
        if found.version != version:
            self.stats.stale += 1
            self.stats.misses += 1
            return None, 0
        limit = min(len(found.ids), len(prompt) - 1)
        same = 0
        while same < limit and found.ids[same] == prompt[same]:
            same += 1
        if same == 0:
            self.stats.misses += 1
            return None, 0
        self.stats.hits += 1
        return found, same

    def put(self, key: Hashable, session: Session) -> None:
        """Keep ``session`` as the newest; evict the oldest while over ``max_bytes``."""
        if self.max_bytes <= 0:
            return
        old = self.held.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self.held[key] = session
        self.nbytes += session.nbytes
        while self.nbytes > self.max_bytes and self.held:
            _, evicted = self.held.popitem(last=False)
            self.nbytes -= evicted.nbytes
            self.stats.evicted += 1

    def drop(self, keys: Iterable[Hashable]) -> int:
        """Forget these sessions (their trajectories ended); how many were held."""
        dropped = 0
        for key in keys:
            found = self.held.pop(key, None)
            if found is not None:
                self.nbytes -= found.nbytes
                dropped += 1
        return dropped

    def clear(self) -> None:
        self.held.clear()
        self.nbytes = 0

    def take_stats(self) -> SessionStats:
        found, self.stats = self.stats, SessionStats()
        return found


@dataclass(frozen=True)
class SessionRequest:
    """A call's sessions: the cache, each prompt's session key (None: none) and the version of
    the weights the call generates with."""

    cache: SessionCache
    keys: Sequence[Hashable | None]
    version: int
