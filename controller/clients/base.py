"""``RoleClient``: how a controller program talks to one role, wherever its group runs.

Programs hold typed clients (this package: ``ActorClient``, ``CriticClient``, ...), one class per
kind of role with one ``async`` method per endpoint, so a program reads
``await actor.compute_log_prob(batch)`` and a type checker sees every call. Each method is one
line through ``RoleClient._call``, which names the transfer protocol the method expects and checks,
before anything is sent, that the role's group registered that endpoint with that protocol: a
client pointed at the wrong kind of role fails at its first call naming both protocols, instead of
returning a result collected the wrong way. ``tests/controller/test_contract.py`` keeps client
methods and role endpoints in step (names, parameters and the types they resolve to, protocols,
result types). Settings and descriptions travel as the typed structs of ``transport/``
(``SamplingConfig``, ``PolicyLossConfig``, ``OptimConfig``, ``WeightSyncSettings``, ``Source``...),
never as loose dicts.

A method's result is what the controller receives after the protocol's collect step: the role
method's return value, except under ``dp-split`` / ``dp-split/ragged`` where anything but a
``TensorBatch`` comes back as a list with one value per dp rank. Every method also takes
``timeout`` (seconds), which overrides ``timeouts.call_s`` for that call and is not passed on.

Calls to roles in different groups overlap under ``asyncio.gather``; calls to colocated roles
queue in order on the shared ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from controller.server import Controller
from transport.batch import TensorBatch
from transport.columns import IDLE, REQUEST, RESPONSE_MASK
from transport.protocol import Transfer
from transport.sampling import SamplingConfig

#: the transfers that split a batch over the dp ranks (a rank with no rows fails its engine)
SPLIT = (Transfer.DP_SPLIT, Transfer.DP_REDUCED)


def idle_rows(batch: TensorBatch, count: int, reduced: bool) -> TensorBatch:
    """``batch`` with its rows repeated up to ``count`` rows, one per dp rank. For a training
    call (``reduced``) the extra rows add nothing to a loss or its counts: their
    ``response_mask`` is 0, or, for text rows (which the ranks tokenize: SFT rows, preference
    pairs), the ``idle`` column marks them (1) for the role to leave out."""
    padded = batch.index(torch.arange(count) % len(batch))
    if not reduced:
        return padded
    mask = padded.tensors.get(RESPONSE_MASK)
    if mask is None:
        padded.tensors[IDLE] = (torch.arange(count) >= len(batch)).long()
        return padded
    mask = mask.clone()
    mask[len(batch) :] = 0
    padded.tensors[RESPONSE_MASK] = mask
    return padded


class ProtocolMismatchError(TypeError):
    """A client method expects another transfer protocol than the role's endpoint declares: the
    client does not fit the role class placed under that name."""


class RoleClient:
    """One role, by name. Subclasses add a typed method per endpoint of the role class."""

    def __init__(self, controller: Controller, role: str) -> None:
        controller.group_of(role)  # unknown role: fail now, not at the first call
        self.controller = controller
        self.role = role

    async def _call(
        self,
        protocol: Transfer,
        method: str,
        *args: Any,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``method`` on the role's ranks under ``protocol`` and return the collected result.
        ``timeout`` (seconds) overrides ``timeouts.call_s`` and is not passed on to the method."""
        self._check(protocol, method)
        shards = self._data_parallel() if protocol in SPLIT else 1
        batch = args[0] if args and isinstance(args[0], TensorBatch) else None
        if batch is None or not 0 < len(batch) < shards:
            return await self.controller.call(self.role, method, list(args), kwargs, timeout)
        # fewer rows than dp ranks: every rank gets one, the extra ones idle
        padded = idle_rows(batch, shards, protocol == Transfer.DP_REDUCED)
        found = await self.controller.call(self.role, method, [padded, *args[1:]], kwargs, timeout)
        if isinstance(found, TensorBatch) and len(found) == shards:
            return found[: len(batch)]
        return found

    def _data_parallel(self) -> int:
        """How many data-parallel shards a ``dp-split`` call to this role is split into."""
        spec = self.controller.group_of(self.role).spec
        return max(1, spec.nproc // (spec.tp * spec.pp))

    def _check(self, protocol: Transfer, method: str) -> None:
        registered = self.controller.group_of(self.role).endpoints.get(self.role)
        if registered is None:
            return  # the group has not built its roles (or never will): the call says why
        found = registered.get(method)
        if found is None:
            raise AttributeError(
                f"role {self.role!r} has no endpoint {method!r}; it has {sorted(registered)} "
                f"(is the role placed under this name of the class {type(self).__name__} expects?)"
            )
        if found != protocol:
            raise ProtocolMismatchError(
                f"{type(self).__name__}.{method} expects transfer protocol {protocol.value!r}, but "
                f"role {self.role!r} registered {method!r} with {found!r}; place a role class "
                f"whose endpoint matches, or use the client written for the placed class"
            )

    @property
    def endpoints(self) -> dict[str, str]:
        """Endpoint name → transfer protocol, as the role's group reported them."""
        return dict(self.controller.group_of(self.role).endpoints.get(self.role, {}))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.role!r})"


def by_request(reply: TensorBatch, sampling: SamplingConfig | None) -> TensorBatch:
    """A generation reply's ``request`` column as the prompt's index in the whole call: each
    shard of a split call numbers its own prompts from 0, and the rows come back request-major
    (``sampling.n`` per prompt), shard after shard."""
    if not isinstance(reply, TensorBatch) or REQUEST not in reply.non_tensors:
        return reply
    if isinstance(sampling, SamplingConfig):
        n = sampling.n
    elif isinstance(sampling, dict):  # the settings as a map (SamplingConfig's fields)
        n = int(sampling.get("n", 1))
    else:  # None: the defaults
        n = 1
    reply.non_tensors[REQUEST] = [row // n for row in range(len(reply))]
    return reply
