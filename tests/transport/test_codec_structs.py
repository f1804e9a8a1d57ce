"""Typed structs through the codec (``transport/structs.py``, ``codec.STRUCTS``): every registered
type round-trips as itself, inside the one header frame; an unknown tag, a malformed payload or a
field that does not validate is a ``ProtocolError``; a type outside the table is refused when
sending, with no pickle ever involved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import pydantic
import pytest

from tests.transport.codec_helpers import make_header, reply, roundtrip
from transport.agent import (
    AgentAsk,
    AgentEnd,
    AgentExchange,
    AgentReply,
    EnvAction,
    EnvOpen,
    EnvResult,
    EnvSpec,
)
from transport.codec import EXT_STRUCT, STRUCTS, HeaderLimits, decode, encode
from transport.protocol import Layout, Message, MsgType, ProtocolError
from transport.sampling import SamplingConfig
from transport.structs import StructError, from_map, to_map
from transport.training import AdamStep, OptimConfig, PolicyLossConfig, ValueLossConfig
from transport.turns import TurnRequest, TurnResult
from transport.weight_sync import (
    Inbox,
    Peer,
    Source,
    Target,
    WeightsReceived,
    WeightsSent,
    WeightSyncSettings,
)

PEERS = [Peer("host-a", ""), Peer("host-b", "other")]
SOURCE = Source(
    "actor",
    Layout(dp=1, tp=2, gen_tp=1),
    "bfloat16",
    [{"name": "w", "shape": [4, 8], "tp_dim": 0, "dp_dim": None, "stage": 0}],
    PEERS,
)
TARGET = Target(
    "rollout",
    Layout(dp=2),
    ["w"],
    {"w": 1},
    [Inbox(PEERS[0], "t0", ipc="ipc:///tmp/x"), Inbox(PEERS[1], "t1", tcp="tcp://h:1", key="k")],
    store="h:29500",
    group_key="abc-actor-2",
)
#: one typical value of every registered struct
EXAMPLES: list[Any] = [
    SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=32, n=4, seed=3),
    SamplingConfig(temperature=0, stop_token_ids=[2, 7]),
    PolicyLossConfig(clip_ratio_high=0.28, kl_coef=0.01, kl_type="low_var_kl", tis_cap=2.0),
    ValueLossConfig(clip=None, agg="seq-mean-token-mean"),
    OptimConfig(lr=3e-6, betas=(0.9, 0.95), schedule="cosine", total_steps=100, grad_clip=None),
    WeightSyncSettings(path="zmq", bucket_mb=0.25, stall_s=5),
    SOURCE,
    TARGET,
    WeightsSent(bytes=1024, seconds=0.5, paths={"0": "shm", "1": "zmq"}, prepare_s=0.01),
    WeightsReceived(version=3, bytes=1024, receive_s=0.4, swap_s=0.02),
    WeightsReceived(version=3, bytes=1024),
    EnvSpec(eos_token_id=2, call_stop_token_ids=[93], call_close="]", format="bracket"),
    EnvOpen(session=4, row={"prompt": "12*34=", "answer": "408", "uid": 0}),
    EnvAction(session=4, text="[calculator 12*34]", finish="stop", turn=0),
    EnvResult(session=4, observation_ids=[32, 61], observation=" = 408\n", called="calculator"),
    TurnRequest(id=3, prompt_ids=[257, 49, 50], seed=11, max_new=16, session="t3", replica=1),
    TurnResult(id=3, tokens=[52, 258], log_probs=[-0.5, -1.25], text="4", finish="stop", version=2),
    AdamStep(lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.01, grad_clip=1.0),
    AgentAsk(session=4, ask=1, prompt_ids=[257, 49], turn=0, max_tokens=8, temperature=1.0),
    AgentReply(
        session=4, ask=1, tokens=[52, 258], log_probs=[-0.5, -1.25], text="4", finish="stop"
    ),
    AgentReply(session=4, ask=2, error="n must be 1", param="n"),
    AgentEnd(
        session=4,
        reward=1.0,
        metrics={"turns_seen": 4.0},
        start=[257, 49],
        ids=[52, 258],
        sampled=[1, 1],
        log_probs=[-0.5, -1.25],
        versions=[2, 2],
        segments=[["sampled", "4"]],
        turns=1,
        finish="stop",
    ),
    AgentEnd(session=5, fault="timeout", message="the agent did not return within 1 s"),
    AgentExchange(asks=[AgentAsk(session=4, ask=1, prompt_ids=[1], turn=0)], ends=[]),
]


def struct_ext(tag: Any, fields: Any) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_STRUCT, msgpack.packb([tag, fields], use_bin_type=True))


def test_every_registered_type_has_an_example() -> None:
    assert {type(x) for x in EXAMPLES} == set(STRUCTS.values())
    assert len(set(STRUCTS.values())) == len(STRUCTS)  # one tag per type


@pytest.mark.parametrize("value", EXAMPLES, ids=lambda x: type(x).__name__)
def test_structs_round_trip_as_themselves(value: Any) -> None:
    out = roundtrip(value)
    assert type(out) is type(value)
    assert out == value


def test_structs_travel_in_the_header_inside_any_container() -> None:
    body = {"role": "actor", "method": "generate", "args": [None, EXAMPLES[0], 3], "kwargs": {}}
    body["kwargs"] = {"loss": EXAMPLES[2], "all": {"sync": [SOURCE, TARGET]}}
    encoded = encode(Message(MsgType.CALL, 1, body))
    assert len(encoded.frames) == 1
    out = decode(encoded.frames).body
    assert out["args"] == body["args"] and out["kwargs"] == body["kwargs"]
    assert isinstance(out["kwargs"]["all"]["sync"][0].layout, Layout)
    assert isinstance(out["kwargs"]["all"]["sync"][1].inboxes[1].peer, Peer)


def test_a_struct_is_a_msgpack_extension_holding_its_tag_and_fields() -> None:
    header = encode(reply(EXAMPLES[5])).frames[0]
    raw = msgpack.unpackb(header, raw=False, ext_hook=lambda code, data: (code, data))
    code, data = raw[3]["result"]
    assert code == EXT_STRUCT
    assert msgpack.unpackb(data, raw=False) == [
        "weight_sync",
        {"path": "zmq", "bucket_mb": 0.25, "stall_s": 5.0},
    ]


def test_an_unknown_struct_tag_is_refused() -> None:
    header = make_header({"result": struct_ext("pickle", {"path": "zmq"})})
    with pytest.raises(ProtocolError, match="unknown struct type 'pickle'"):
        decode([header])
    with pytest.raises(ProtocolError, match="unknown struct type 7"):
        decode([make_header({"result": struct_ext(7, {})})])


@pytest.mark.parametrize(
    "payload",
    [None, [], ["sampling"], ["sampling", {}, {}], "sampling", ["sampling", [1.0, 0.9]]],
    ids=repr,
)
def test_malformed_struct_payloads_are_refused(payload: Any) -> None:
    ext = msgpack.ExtType(EXT_STRUCT, msgpack.packb(payload, use_bin_type=True))
    with pytest.raises(ProtocolError, match="struct"):
        decode([make_header({"result": ext})])


@pytest.mark.parametrize(
    ("tag", "fields", "named"),
    [
        ("sampling", {"temperature": -1.0}, "temperature"),
        ("sampling", {"temperature": 0.0, "n": 4}, "greedy"),
        ("sampling", {"beams": 2}, "beams"),  # unknown fields are refused, not dropped
        ("policy_loss", {"dual_clip": 0.5}, "dual_clip"),
        ("optim", {"schedule": "cosine"}, "total_steps"),
        ("weight_sync", {"path": "carrier-pigeon"}, "path"),
        ("weight_source", {**to_map(SOURCE), "peers": [{"host": "h"}]}, "cluster"),
        ("weight_source", {**to_map(SOURCE), "layout": {"dp": 0}}, "layout.dp=0"),
        ("weight_source", {**to_map(SOURCE), "layout": {"dp": True}}, "dp"),
        ("weight_target", {**to_map(TARGET), "splits": {"w": "one"}}, "splits"),
        ("weights_received", {"version": "three", "bytes": 1}, "version"),
    ],
)
def test_fields_that_do_not_validate_are_refused(tag: str, fields: Any, named: str) -> None:
    with pytest.raises(ProtocolError, match=f"struct {tag!r}.*{named}"):
        decode([make_header({"result": struct_ext(tag, fields)})])


class Unlisted(pydantic.BaseModel):
    x: int = 1


@dataclass(frozen=True)
class UnlistedData:
    x: int = 1


class SubSampling(SamplingConfig):
    pass


@pytest.mark.parametrize(
    "value",
    [Unlisted(), UnlistedData(), SubSampling(), Layout(), Peer("h", "")],
    ids=lambda x: type(x).__name__,
)
def test_types_outside_the_table_are_refused_when_sending(value: Any) -> None:
    with pytest.raises(TypeError, match="no pickle"):
        encode(reply(value))


def test_a_peer_that_may_send_no_extension_may_send_no_struct() -> None:
    header = encode(reply(EXAMPLES[0])).frames[0]
    with pytest.raises(ProtocolError, match="max_ext_len"):
        decode([header], limits=HeaderLimits(ext_bytes=0))


def test_settings_are_frozen_so_what_is_sent_was_validated() -> None:
    sampling = SamplingConfig()
    with pytest.raises(pydantic.ValidationError):
        sampling.temperature = -1.0  # type: ignore[misc]


def test_from_map_names_the_struct_and_field() -> None:
    assert from_map(Layout, {"dp": 2, "tp": 1, "pp": 1}) == Layout(dp=2)
    with pytest.raises(StructError, match=r"bad SamplingConfig: top_p: Input should be less"):
        from_map(SamplingConfig, {"top_p": 2.0})
