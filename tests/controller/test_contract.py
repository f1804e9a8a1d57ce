"""The contract between typed role clients (``controller/clients/``) and role classes.

``disagreements(client, role)`` lists every way a client class and a role class are out of step:
an endpoint with no client method, a client method with no endpoint, a different parameter list
(names, kinds, defaults, annotations; ``self`` and the client-only ``timeout`` aside), a parameter
whose annotation, resolved in its module, is another type than the endpoint's (a look-alike class
of the same name, a dict where the role takes a struct), a result type other than what the
endpoint's transfer protocol collects, and — by driving each client
method against a recording ``_call`` — a protocol, endpoint name, argument or timeout the method
does not send as declared. ``CONTRACT`` pairs every client with the role class(es) it speaks to;
the tests below also prove the checker catches each kind of drift, so it cannot pass silently.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import pkgutil
import typing
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import pytest

import roles
from controller import clients as controller_clients
from controller.clients import (
    ActorClient,
    CriticClient,
    EngineClient,
    EnvClient,
    LinearRegressorClient,
    ProtocolMismatchError,
    ReferenceClient,
    RewardClient,
    RewardModelClient,
    RoleClient,
    RolloutClient,
    WeightSinkClient,
    WeightSourceClient,
)
from controller.server import Controller
from roles.actor import Actor, Reference, Teacher
from roles.critic import Critic
from roles.demo import LinearRegressor
from roles.engine_role import EngineRole
from roles.env import EnvRole
from roles.judge import JudgeReward
from roles.reward import ModelReward, RuleReward
from roles.rollout import Rollout
from roles.runtime.endpoint import DP_RAGGED, ONE_TO_ALL, endpoint, endpoints_of
from roles.weight_sync import WeightSink, WeightSource
from tests.fixtures import actor as fixture_actor
from tests.fixtures import clients as fixture_clients
from tests.fixtures import roles as fixture_roles
from tests.fixtures.actor import GenerationProbedActor, ProbedActor, SlowActor
from tests.fixtures.clients import (
    DeviceProbeClient,
    EchoClient,
    FaultyClient,
    GenerationProbedActorClient,
    ProbedActorClient,
    SlowActorClient,
    SummerClient,
)
from tests.fixtures.roles import DeviceProbe, Echo, Faulty, Summer
from transport.batch import TensorBatch
from transport.protocol import Transfer

#: client class -> the role classes it speaks to
CONTRACT: list[tuple[type[RoleClient], type]] = [
    (EngineClient, EngineRole),
    (ReferenceClient, Reference),
    (ReferenceClient, Teacher),
    (ActorClient, Actor),
    (CriticClient, Critic),
    (RewardClient, RuleReward),
    (RewardClient, JudgeReward),
    (RewardModelClient, ModelReward),
    (RolloutClient, Rollout),
    (WeightSinkClient, WeightSink),
    (WeightSourceClient, WeightSource),
    (LinearRegressorClient, LinearRegressor),
    (EnvClient, EnvRole),
    (EchoClient, Echo),
    (FaultyClient, Faulty),
    (DeviceProbeClient, DeviceProbe),
    (ProbedActorClient, ProbedActor),
    (GenerationProbedActorClient, GenerationProbedActor),
    (SlowActorClient, SlowActor),
    (SummerClient, Summer),
]
CLIENT_ONLY = "timeout"  # the per-call timeout: the client's, never sent to the role
#: protocols whose collect step lists non-batch results by dp rank instead of returning one
LISTED_BY_DP = (Transfer.DP_SPLIT, Transfer.DP_RAGGED, Transfer.MICRO_DP)


# -- the checker ---------------------------------------------------------------------------------


def disagreements(client: type[RoleClient], role: type) -> list[str]:
    """Every way ``client`` and ``role`` are out of step, one sentence each (empty: in step)."""
    specs = endpoints_of(role)
    methods = client_methods(client)
    found = [
        f"{role.__name__}.{name} has no client method in {client.__name__}"
        for name in sorted(set(specs) - set(methods))
    ]
    found += [
        f"{client.__name__}.{name} calls no endpoint of {role.__name__}"
        for name in sorted(set(methods) - set(specs))
    ]
    for name in sorted(set(specs) & set(methods)):
        protocol = Transfer(specs[name].protocol.name)
        target = getattr(role, name)
        found += _signature_disagreements(client, role, name, methods[name], target, protocol)
        found += _sent_disagreements(client, role, name, target, protocol)
    return found


def client_methods(client: type[RoleClient]) -> dict[str, Callable[..., Any]]:
    """The public coroutine methods of a client class: one per endpoint it calls."""
    return {
        name: fn
        for name, fn in inspect.getmembers(client, inspect.iscoroutinefunction)
        if not name.startswith("_")
    }


def collected(protocol: Transfer, returns: str) -> str:
    """The type the controller receives from an endpoint that returns ``returns``."""
    if protocol in LISTED_BY_DP and returns != "TensorBatch":
        return f"list[{returns}]"
    return returns


def _text(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _parameters(fn: Callable[..., Any], skip: tuple[str, ...]) -> inspect.Signature:
    params = [p for p in inspect.signature(fn).parameters.values() if p.name not in skip]
    return inspect.Signature([p.replace(annotation=_text(p.annotation)) for p in params])


def _signature_disagreements(
    client: type[RoleClient],
    role: type,
    name: str,
    method: Callable[..., Any],
    target: Callable[..., Any],
    protocol: Transfer,
) -> list[str]:
    found = []
    where = f"{client.__name__}.{name} vs {role.__name__}.{name}"
    theirs = _parameters(target, ("self",))
    if CLIENT_ONLY in theirs.parameters:
        found.append(
            f"{role.__name__}.{name} has a parameter {CLIENT_ONLY!r}, which clients keep for the "
            "per-call timeout; rename the endpoint's parameter"
        )
    ours = _parameters(method, ("self", CLIENT_ONLY))
    if str(ours) != str(theirs):
        found.append(f"{where}: parameters {ours} != {theirs}")
    expected = collected(protocol, _text(inspect.signature(target).return_annotation))
    returns = _text(inspect.signature(method).return_annotation)
    if returns != expected:
        found.append(
            f"{where}: the client returns {returns}, the controller receives {expected} "
            f"(the endpoint returns {_text(inspect.signature(target).return_annotation)} "
            f"under {protocol.value})"
        )
    return found + _type_disagreements(where, method, target, protocol)


def _hints(fn: Callable[..., Any]) -> dict[str, Any] | str:
    """The annotations of ``fn`` resolved in its own module (or why they cannot be)."""
    try:
        return typing.get_type_hints(fn)
    except Exception as exc:  # NameError and the like: say which function, and how it failed
        return f"the annotations of {fn.__qualname__} do not resolve: {exc!r}"


def _type_disagreements(
    where: str, method: Callable[..., Any], target: Callable[..., Any], protocol: Transfer
) -> list[str]:
    """Each parameter's type, and the result's, as objects: the same text can name two classes
    (a look-alike defined elsewhere, an import of another module's class of that name)."""
    ours, theirs = _hints(method), _hints(target)
    if isinstance(ours, str) or isinstance(theirs, str):
        return [f"{where}: {h}" for h in (ours, theirs) if isinstance(h, str)]
    found = [
        f"{where}: parameter {name!r} is {ours.get(name)!r} in the client, {kind!r} in the role"
        for name, kind in theirs.items()
        if name != "return" and ours.get(name) != kind
    ]
    expected = theirs.get("return")
    if protocol in LISTED_BY_DP and expected is not TensorBatch:
        expected = list[expected]  # type: ignore[valid-type]
    if ours.get("return") != expected:
        found.append(f"{where}: the client returns {ours.get('return')!r}, not {expected!r}")
    return found


@dataclass(frozen=True)
class _Stand:
    """The stand-in value of one parameter, so we can see where each one arrives."""

    param: str


def _sent_disagreements(
    client: type[RoleClient], role: type, name: str, target: Callable[..., Any], protocol: Transfer
) -> list[str]:
    """Drive the client method with stand-ins and compare what it would send with the endpoint."""
    sent = _record(client, name)
    if isinstance(sent, str):
        return [sent]
    where = f"{client.__name__}.{name}"
    found = []
    if sent["protocol"] != protocol:
        found.append(
            f"{where} sends under {_text(sent['protocol'])}, {role.__name__}.{name} is "
            f"{protocol.value}"
        )
    if sent["method"] != name:
        found.append(f"{where} calls endpoint {sent['method']!r}, not {name!r}")
    if sent["timeout"] != _Stand(CLIENT_ONLY):
        found.append(f"{where} does not pass its timeout on to _call")
    signature = inspect.signature(target)
    try:
        bound = signature.bind(None, *sent["args"], **sent["kwargs"]).arguments
    except TypeError as exc:
        return [*found, f"{where} sends arguments {role.__name__}.{name} cannot take: {exc}"]
    for param in list(signature.parameters)[1:]:
        if param not in bound:
            found.append(f"{where} does not send {role.__name__}.{name}'s {param!r}")
        elif bound[param] != _Stand(param):
            found.append(f"{where} sends {bound[param]!r} as {role.__name__}.{name}'s {param!r}")
    return found


def _record(client: type[RoleClient], name: str) -> dict[str, Any] | str:
    """What ``client.name`` hands ``_call`` when every parameter gets its own stand-in (or why it
    could not be driven)."""
    seen: dict[str, Any] = {}

    class Recording(client):  # type: ignore[valid-type, misc]
        async def _call(
            self, protocol: Transfer, method: str, *args: Any, timeout: Any = None, **kwargs: Any
        ) -> Any:
            seen.update(protocol=protocol, method=method, args=args, kwargs=kwargs, timeout=timeout)

    params = list(inspect.signature(getattr(client, name)).parameters.values())[1:]
    positional = [
        _Stand(p.name) for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    keywords = {p.name: _Stand(p.name) for p in params if p.kind == p.KEYWORD_ONLY}
    instance = Recording(cast(Controller, _Placement({})), "role")
    try:
        asyncio.run(getattr(instance, name)(*positional, **keywords))
    except Exception as exc:  # a client method does more than forward: say so, and how it failed
        return f"{client.__name__}.{name} could not be driven with stand-ins: {exc!r}"
    if not seen:
        return f"{client.__name__}.{name} never calls _call"
    return seen


class _Placement:
    """Stands in for the controller: one role's registered endpoints, and the calls it was sent."""

    def __init__(self, endpoints: dict[str, str] | None) -> None:
        self.endpoints = endpoints
        self.calls: list[tuple[Any, ...]] = []

    def group_of(self, role: str) -> SimpleNamespace:
        if role == "ghost":
            raise KeyError(f"no role {role!r} in this placement")
        return SimpleNamespace(endpoints={} if self.endpoints is None else {role: self.endpoints})

    async def call(
        self, role: str, method: str, args: list[Any], kwargs: dict[str, Any], timeout: Any
    ) -> str:
        self.calls.append((role, method, args, kwargs, timeout))
        return "sent"


# -- the contract --------------------------------------------------------------------------------


@pytest.mark.parametrize(("client", "role"), CONTRACT, ids=[c.__name__ for c, _ in CONTRACT])
def test_client_and_role_are_in_step(client: type[RoleClient], role: type) -> None:
    assert disagreements(client, role) == []


def _classes(module: Any, kind: type) -> set[type]:
    return {
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, kind)
        and value.__module__ == module.__name__
    }


def test_every_client_class_is_in_the_contract() -> None:
    modules = [fixture_clients] + [
        importlib.import_module(f"controller.clients.{m.name}")
        for m in pkgutil.iter_modules(controller_clients.__path__)
    ]
    defined = set().union(*(_classes(m, RoleClient) for m in modules)) - {RoleClient}
    assert defined == {client for client, _ in CONTRACT}


def test_every_role_class_with_endpoints_is_in_the_contract() -> None:
    modules = [fixture_roles, fixture_actor] + [
        importlib.import_module(f"roles.{m.name}")
        for m in pkgutil.iter_modules(roles.__path__)
        if not m.ispkg
    ]
    defined = {c for m in modules for c in _classes(m, object) if endpoints_of(c)}
    assert defined == {role for _, role in CONTRACT}


# -- the checker catches drift -------------------------------------------------------------------


def rebuilt(cls: type, rename: dict[str, str]) -> type:
    """``cls`` built afresh with some attributes under new names (a subclass cannot drop one)."""
    namespace = {
        rename.get(k, k): v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")
    }
    return type(cls.__name__, cls.__bases__, namespace)


def test_a_renamed_endpoint_is_caught() -> None:
    renamed = rebuilt(Echo, {"where": "whereabouts"})
    assert disagreements(EchoClient, renamed) == [
        "Echo.whereabouts has no client method in EchoClient",
        "EchoClient.where calls no endpoint of Echo",
    ]


def test_a_renamed_client_method_is_caught() -> None:
    renamed = rebuilt(FaultyClient, {"sleep": "nap"})
    found = disagreements(renamed, Faulty)
    assert "Faulty.sleep has no client method in FaultyClient" in found
    assert "FaultyClient.nap calls no endpoint of Faulty" in found


def test_a_changed_protocol_is_caught() -> None:
    class Moved(Echo):
        @endpoint(ONE_TO_ALL)  # was rank-zero
        def only_zero(self) -> int:
            return 0

    assert disagreements(EchoClient, Moved) == [
        "EchoClient.only_zero sends under rank-zero, Moved.only_zero is one-to-all"
    ]


def test_a_client_sending_under_another_protocol_is_caught() -> None:
    class Wrong(EchoClient):
        async def only_zero(self, *, timeout: float | None = None) -> int:
            return await self._call(Transfer.ONE_TO_ALL, "only_zero", timeout=timeout)

    assert disagreements(Wrong, Echo) == [
        "Wrong.only_zero sends under one-to-all, Echo.only_zero is rank-zero"
    ]


CHANGED_PARAMETERS = {
    "default": "def fail_on(self, rank: int, message: str = 'kaput') -> int: ...",
    "name": "def fail_on(self, rank: int, text: str = 'boom') -> int: ...",
    "kind": "def fail_on(self, rank: int, *, message: str = 'boom') -> int: ...",
    "annotation": "def fail_on(self, rank: str, message: str = 'boom') -> int: ...",
    "added": "def fail_on(self, rank: int, message: str = 'boom', again: bool = False) -> int: ...",
    "removed": "def fail_on(self, rank: int) -> int: ...",
    "result": "def fail_on(self, rank: int, message: str = 'boom') -> float: ...",
}


@pytest.mark.parametrize("change", sorted(CHANGED_PARAMETERS))
def test_a_changed_parameter_is_caught(change: str) -> None:
    namespace: dict[str, Any] = {}
    source = "from __future__ import annotations\n" + CHANGED_PARAMETERS[change]
    exec(source, {}, namespace)  # annotations stay text, as in the role modules
    changed = type("Changed", (Faulty,), {"fail_on": endpoint(ONE_TO_ALL)(namespace["fail_on"])})
    found = disagreements(FaultyClient, changed)
    assert found, f"a {change} change of fail_on went unnoticed"
    assert found[0].startswith("FaultyClient.fail_on vs Changed.fail_on: ")
    assert all("fail_on" in line for line in found)


def test_a_look_alike_type_of_the_same_name_is_caught() -> None:
    """The text of the annotations agrees, the classes do not: a role whose ``sampling`` is a
    class of its own named ``SamplingConfig`` would refuse what the client sends."""
    namespace: dict[str, Any] = {
        "SamplingConfig": type("SamplingConfig", (), {}),  # not transport.sampling's
        "TensorBatch": TensorBatch,
    }
    source = (
        "from __future__ import annotations\n"
        "def generate(self, batch: TensorBatch, sampling: SamplingConfig | None = None, "
        "min_version: int = 0) -> TensorBatch: ..."
    )
    exec(source, namespace)
    changed = type("Changed", (Rollout,), {"generate": endpoint(DP_RAGGED)(namespace["generate"])})
    found = disagreements(RolloutClient, changed)
    assert len(found) == 1, found
    assert found[0].startswith("RolloutClient.generate vs Changed.generate: parameter 'sampling' ")
    assert "transport.sampling.SamplingConfig | None in the client" in found[0]


def test_a_dict_where_the_role_takes_a_struct_is_caught() -> None:
    class Loose(RolloutClient):
        async def generate(
            self,
            batch: TensorBatch,
            sampling: dict[str, Any] | None = None,
            min_version: int = 0,
            *,
            timeout: float | None = None,
        ) -> TensorBatch:
            return await self._call(
                Transfer.DP_RAGGED, "generate", batch, sampling, min_version, timeout=timeout
            )

    found = disagreements(Loose, Rollout)
    assert any("parameter 'sampling' is dict[str, typing.Any] | None" in f for f in found), found


def test_unresolvable_annotations_are_reported() -> None:
    namespace: dict[str, Any] = {}
    source = (
        "from __future__ import annotations\n"
        "def fail_on(self, rank: int, message: Nowhere = 'boom') -> int: ..."
    )
    exec(source, namespace)
    changed = type("Changed", (Faulty,), {"fail_on": endpoint(ONE_TO_ALL)(namespace["fail_on"])})
    assert any("do not resolve" in f for f in disagreements(FaultyClient, changed))


def test_a_method_that_drops_or_moves_an_argument_is_caught() -> None:
    class Sloppy(FaultyClient):
        async def fail_on(
            self, rank: int, message: str = "boom", *, timeout: float | None = None
        ) -> int:
            return await self._call(Transfer.ONE_TO_ALL, "fail_on", rank, timeout=timeout)

        async def sleep(self, seconds: float, *, timeout: float | None = None) -> float:
            return await self._call(Transfer.ONE_TO_ALL, "slep", seconds)

    assert disagreements(Sloppy, Faulty) == [
        "Sloppy.fail_on does not send Faulty.fail_on's 'message'",
        "Sloppy.sleep calls endpoint 'slep', not 'sleep'",
        "Sloppy.sleep does not pass its timeout on to _call",
    ]


def test_an_endpoint_parameter_named_timeout_is_caught() -> None:
    class Slow(Faulty):
        @endpoint(ONE_TO_ALL)
        def sleep(self, timeout: float) -> float:
            return timeout

    assert any("parameter 'timeout'" in line for line in disagreements(FaultyClient, Slow))


def test_dp_split_results_other_than_batches_come_back_listed() -> None:
    assert collected(Transfer.DP_SPLIT, "int") == "list[int]"
    assert collected(Transfer.DP_SPLIT, "TensorBatch") == "TensorBatch"
    assert collected(Transfer.DP_REDUCED, "dict[str, float]") == "dict[str, float]"
    assert collected(Transfer.RANK_ZERO, "int") == "int"


# -- the client's check before sending ----------------------------------------------------------


def client_on(endpoints: dict[str, str] | None) -> tuple[EchoClient, _Placement]:
    placement = _Placement(endpoints)
    return EchoClient(cast(Controller, placement), "echo"), placement


def test_a_call_goes_out_when_the_group_registered_the_endpoint_with_its_protocol() -> None:
    echo, placement = client_on({"only_zero": "rank-zero", "echo": "one-to-all"})
    assert asyncio.run(echo.only_zero(timeout=2.0)) == "sent"
    assert asyncio.run(echo.echo([1])) == "sent"
    assert placement.calls == [
        ("echo", "only_zero", [], {}, 2.0),
        ("echo", "echo", [[1]], {}, None),
    ]


def test_a_protocol_the_group_did_not_register_fails_before_sending() -> None:
    echo, placement = client_on({"only_zero": "one-to-all"})
    with pytest.raises(ProtocolMismatchError, match=r"'rank-zero'.*'one-to-all'"):
        asyncio.run(echo.only_zero())
    assert placement.calls == []


def test_an_endpoint_the_group_did_not_register_fails_before_sending() -> None:
    echo, placement = client_on({"echo": "one-to-all"})
    with pytest.raises(AttributeError, match=r"no endpoint 'where'; it has \['echo'\]"):
        asyncio.run(echo.where())
    assert placement.calls == []


def test_a_group_that_has_not_built_its_roles_leaves_the_answer_to_the_controller() -> None:
    echo, placement = client_on(None)
    assert asyncio.run(echo.ping()) == "sent"
    assert placement.calls == [("echo", "ping", [], {}, None)]


def test_an_unknown_role_fails_when_the_client_is_made() -> None:
    with pytest.raises(KeyError, match="no role 'ghost'"):
        EchoClient(cast(Controller, _Placement({})), "ghost")
