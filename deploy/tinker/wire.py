"""Tinker's wire formats read into the mesh's types, and the mesh's results written back: the
protobuf messages of ``forward_backward`` and of sampling results (``tinker_public``, from the
SDK's own package), the loss functions by name, the checkpoint paths.

What the mesh does not do is refused here, before it reaches a group, with a ``Refused`` that
names the field (the server answers 400 with it, which the SDK raises as ``BadRequestError``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from controller.datum import Datum
from transport.training import PolicyLossConfig

#: the loss functions served, by Tinker's name (the others of the SDK's list are refused)
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
#: PPO's, CISPO's and GSPO's ratio bounds when the call gives none (Tinker's for PPO; its
#: documentation does not show GSPO's, taken to be the same)
CLIP_LOW, CLIP_HIGH = 0.8, 1.2
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
#: the per-token inputs a datum may carry, by loss
_INPUTS = {
    "cross_entropy": {"target_tokens", "weights"},
    "importance_sampling": {"target_tokens", "logprobs", "advantages"},
    "ppo": {"target_tokens", "logprobs", "advantages"},
    "cispo": {"target_tokens", "logprobs", "advantages"},
    "dro": {"target_tokens", "logprobs", "advantages"},
    "gspo": {"target_tokens", "logprobs", "advantages", "sequence_ratio_mask"},
}
#: what each loss reads of ``loss_fn_config``
_CONFIG = {
    "ppo": {"clip_low_threshold", "clip_high_threshold"},
    "cispo": {"clip_low_threshold", "clip_high_threshold"},
    "dro": {"beta"},
    "gspo": {"clip_low_threshold", "clip_high_threshold"},
}


class Refused(Exception):
    """A request this server does not serve, or cannot: its message names the field; ``status``
    the HTTP status it is answered with (400: the SDK's ``BadRequestError``)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


Loss = PolicyLossConfig | Literal["cross_entropy"]


@dataclass(frozen=True)
class Batch:
    """One ``forward_backward`` or ``forward`` request as the mesh takes it."""

    model_id: str
    seq_id: int
    rows: list[Datum]
    loss: Loss
    name: str
    forward_only: bool


def forward_backward_request(body: bytes) -> pb.ForwardBackwardRequest:
    """The protobuf request, or ``Refused`` when it is none (its datums are read by
    ``batch_of``, in the call's turn: a refusal then still takes its place in the order)."""
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise Refused(f"forward_backward: not a ForwardBackwardRequest ({exc})") from None
    if not request.model_id:
        raise Refused("forward_backward: model_id is missing")
    return request


def batch_of(request: pb.ForwardBackwardRequest) -> Batch:
    """A ``ForwardBackwardRequest``'s datums as ``Datum`` rows and its loss as the mesh's;
    ``Refused`` naming the datum and field where it cannot be."""
    if not request.data:
        raise Refused("forward_backward: no datums")
    name = request.loss_fn
    if name not in LOSSES:
        raise Refused(
            f"loss_fn {name!r} is not served here; this server has {', '.join(LOSSES)} "
            "(and forward_backward_custom, which the SDK builds on cross_entropy)"
        )
    config = loss_config(request)
    rows = [datum_row(d, i, name) for i, d in enumerate(request.data)]
    return Batch(
        request.model_id, request.seq_id, rows, loss_of(name, config), name, request.forward_only
    )


def loss_config(request: pb.ForwardBackwardRequest) -> dict[str, float]:
    """``loss_fn_config`` (its second map first, where the SDK writes every value); a text
    value is refused by name: no served loss takes one."""
    found: dict[str, float] = dict(request.loss_fn_config)
    for key, value in request.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise Refused(f"loss_fn_config[{key!r}]: a text value; the losses here take numbers")
        found[key] = value.number
    return found


def loss_of(name: str, config: Mapping[str, float]) -> Loss:
    """Tinker's loss ``name`` with ``config`` as the mesh's loss (a summed loss: Tinker's
    losses are sums over tokens)."""
    known = _CONFIG.get(name, set())
    unknown = sorted(set(config) - known)
    if unknown:
        raise Refused(
            f"loss_fn_config for {name}: {', '.join(unknown)} is not read here"
            + (f" (it reads {', '.join(sorted(known))})" if known else " (it takes none)")
        )
    if name == "cross_entropy":
        return "cross_entropy"
    if name == "importance_sampling":
        return PolicyLossConfig(kind="importance_sampling", dual_clip=None)
    if name == "dro":  # Tinker's dro takes beta from each call: no default is assumed here
        if "beta" not in config:
            raise Refused("loss_fn_config for dro: beta is required (its quadratic penalty)")
        if not config["beta"] >= 0:
            raise Refused(f"loss_fn_config for dro: beta {config['beta']} must be >= 0")
        return PolicyLossConfig(kind="dro", dro_beta=config["beta"], dual_clip=None)
    low = config.get("clip_low_threshold", CLIP_LOW)
    high = config.get("clip_high_threshold", CLIP_HIGH)
    if not 0 <= low <= 1 <= high:
        raise Refused(
            f"loss_fn_config for {name}: clip_low_threshold {low} and clip_high_threshold "
            f"{high} must satisfy 0 <= low <= 1 <= high"
        )
    if name == "gspo":  # GSPO-token, summed over tokens as Tinker's losses are
        return PolicyLossConfig(
            kind="gspo-token",
            clip_ratio_low=1 - low,
            clip_ratio_high=high - 1,
            dual_clip=None,
            agg="token-mean",
        )
    return PolicyLossConfig(
        kind="ppo" if name == "ppo" else "cispo",
        clip_ratio_low=1 - low,
        clip_ratio_high=high - 1,
        dual_clip=None,
    )


def tokens_of(chunks: Sequence[pb.Chunk], where: str) -> list[int]:
    """The token ids of a model input's chunks (text only: images and audio are refused)."""
    found: list[int] = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise Refused(f"{where}: a chunk of kind {kind!r}; only encoded_text is served")
        found += np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist()
    return found


def tensor_of(t: pb.Tensor, where: str) -> np.ndarray:
    """A ``Tensor``'s values (dense, or sparse CSR made dense), flattened."""
    kind = _DTYPES.get(t.dtype)
    if kind is None:
        raise Refused(f"{where}: dtype {pb.DType.Name(t.dtype)} is not served")
    dtype = np.dtype(kind).newbyteorder("<")
    if t.WhichOneof("encoding") == "sparse_csr":
        shape = tuple(t.shape)
        if len(shape) != 2:
            raise Refused(f"{where}: a sparse tensor of shape {shape}; give 2 dimensions")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.frombuffer(t.sparse_csr.crow_indices, dtype="<i8")
        cols = np.frombuffer(t.sparse_csr.col_indices, dtype="<i8")
        values = np.frombuffer(t.sparse_csr.values, dtype=dtype)
        for r in range(shape[0]):
            dense[r, cols[rows[r] : rows[r + 1]]] = values[rows[r] : rows[r + 1]]
        return dense.reshape(-1)
    values = np.frombuffer(t.dense, dtype=dtype)
    if t.shape and math.prod(t.shape) != values.size:
        raise Refused(f"{where}: shape {list(t.shape)} does not hold {values.size} values")
    return values


def datum_row(datum: pb.Datum, i: int, loss: str) -> Datum:
    """A Tinker datum (``model_input`` predicts ``target_tokens`` position by position) as a
    ``Datum``: the first token is its prompt, the targets its response, each per-token input
    at its target."""
    where = f"datum {i}"
    tokens = tokens_of(datum.model_input, f"{where}.model_input")
    inputs = {
        name: tensor_of(t, f"{where}.loss_fn_inputs[{name!r}]")
        for name, t in datum.loss_fn_inputs.items()
    }
    extra = sorted(set(inputs) - _INPUTS[loss])
    if extra:
        raise Refused(
            f"{where}.loss_fn_inputs: {', '.join(extra)} is not read by {loss} (it reads "
            f"{', '.join(sorted(_INPUTS[loss]))})"
        )
    needed = sorted(_INPUTS[loss] - {"weights", "sequence_ratio_mask"} - set(inputs))
    if needed:
        raise Refused(f"{where}.loss_fn_inputs: {loss} needs {', '.join(needed)}")
    if not tokens:
        raise Refused(f"{where}.model_input: no tokens")
    targets = inputs["target_tokens"].astype(np.int64).tolist()
    n = len(tokens)
    for name, values in inputs.items():
        if values.size != n:
            raise Refused(
                f"{where}.loss_fn_inputs[{name!r}]: {values.size} values for {n} input tokens; "
                "give one per position"
            )
    if targets[:-1] != tokens[1:]:
        at = next(j for j, (a, b) in enumerate(zip(targets, tokens[1:], strict=False)) if a != b)
        raise Refused(
            f"{where}: target_tokens[{at}] is {targets[at]} where model_input[{at + 1}] is "
            f"{tokens[at + 1]}; the targets must be the input shifted by one token (the "
            "next-token layout), which is what this server trains"
        )

    def per_token(name: str) -> list[float] | None:
        return inputs[name].astype(np.float64).tolist() if name in inputs else None

    ratio_mask = per_token("sequence_ratio_mask")
    if ratio_mask is not None and not any(ratio_mask):
        raise Refused(
            f"{where}.loss_fn_inputs['sequence_ratio_mask']: marks no position; GSPO's sequence "
            "ratio is the mean log-ratio over the positions it marks (the sampled tokens)"
        )
    if loss == "gspo" and ratio_mask is None:  # the cookbook's rl/train.py sends none: the
        # sampled tokens are those with an advantage (a datum with none has a zero loss)
        ratio_mask = [1.0 if a != 0 else 0.0 for a in inputs["advantages"].tolist()]
    return Datum(
        prompt=tokens[:1],
        response=targets,
        advantages=per_token("advantages"),
        old_log_probs=per_token("logprobs"),
        weights=per_token("weights") if loss == "cross_entropy" else None,
        ratio_mask=ratio_mask,
    )


def summed_loss(batch: Batch, logprobs: Sequence[Sequence[float]]) -> float:
    """The loss a ``forward`` alone reports, from its log-probs, as the mesh's losses sum it:
    cross-entropy -w log p; importance sampling -r A; PPO -min(r A, clip(r) A); CISPO
    -clip(r) A log p (its value: the clipped ratio is a constant weight), r = p / p_old; DRO
    -(A log p - beta / 2 log^2 r); GSPO -min(s A, clip(s) A) with every token's ratio the
    sequence's s, the geometric mean of r over the positions ``ratio_mask`` marks."""
    total = 0.0
    loss = batch.loss
    for row, lp in zip(batch.rows, logprobs, strict=True):
        x = np.asarray(lp, dtype=np.float64)
        if loss == "cross_entropy":
            w = np.asarray(row.weights if row.weights is not None else np.ones_like(x))
            total -= float((w * x).sum())
            continue
        r = np.exp(x - np.asarray(row.old_log_probs, dtype=np.float64))
        a = np.asarray(row.advantages, dtype=np.float64)
        if loss.kind == "importance_sampling":
            total -= float((r * a).sum())
            continue
        if loss.kind == "dro":
            old_lp = np.asarray(row.old_log_probs, dtype=np.float64)
            total -= float((a * x - 0.5 * loss.dro_beta * (x - old_lp) ** 2).sum())
            continue
        if loss.kind == "gspo-token":
            marked = np.asarray(row.ratio_mask, dtype=np.float64) != 0
            r = np.full_like(r, np.exp(np.log(r[marked]).mean()) if marked.any() else 1.0)
        high = loss.clip_ratio_high if loss.clip_ratio_high is not None else loss.clip_ratio_low
        clipped = np.clip(r, 1 - loss.clip_ratio_low, 1 + high)
        if loss.kind in ("ppo", "gspo-token"):
            total -= float(np.minimum(r * a, clipped * a).sum())
        else:
            total -= float((clipped * a * x).sum())
    return total


def forward_output(logprobs: Sequence[Sequence[float]], metrics: Mapping[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: each datum's per-target log-probs, and the metrics (keys
    ``name:reduction``, which the SDK merges chunk by chunk)."""
    data = b"".join(np.asarray(lp, dtype="<f4").tobytes() for lp in logprobs)
    offsets = np.cumsum([0, *(4 * len(lp) for lp in logprobs)]).astype("<i8")
    record = pb.ArrayRecord(num_datums=len(logprobs))
    record.fields["logprobs"].CopyFrom(
        pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)
    )
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return bytes(out.SerializeToString())


@dataclass(frozen=True)
class Sampled:
    """One sampled sequence: its tokens, their log-probs, whether a stop ended it."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool


def sample_output(sequences: Sequence[Sampled], prompt_logprobs: list[float] | None) -> bytes:
    """A ``SampleResponse``; ``prompt_logprobs`` one per prompt token (NaN at the first)."""
    out = pb.SampleResponse()
    for s in sequences:
        out.sequences.append(
            pb.SampledSequence(
                stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
                tokens=np.asarray(s.tokens, dtype="<i4").tobytes(),
                logprobs=np.asarray(s.logprobs, dtype="<f4").tobytes(),
            )
        )
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    return bytes(out.SerializeToString())


#: the kinds of checkpoint a ``tinker://`` path names
KINDS = ("weights", "sampler_weights")


def tinker_path(model_id: str, kind: str, name: str) -> str:
    """``tinker://MODEL/KIND/NAME`` (the SDK splits it on ``/`` into exactly three parts)."""
    return f"tinker://{model_id}/{kind}/{name}"


def parse_path(path: str, where: str) -> tuple[str, str, str]:
    """(model id, kind, name) of a ``tinker://`` path, or ``Refused`` naming it."""
    parts = path.removeprefix("tinker://").split("/")
    if not path.startswith("tinker://") or len(parts) != 3 or parts[1] not in KINDS:
        raise Refused(
            f"{where}: {path!r} is not a checkpoint path of this server (tinker://MODEL/"
            f"{{{'|'.join(KINDS)}}}/NAME)"
        )
    return parts[0], parts[1], parts[2]


def check_name(name: str, where: str) -> str:
    """A checkpoint name: a path part of its own (no ``/``, not ``.`` or ``..``)."""
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise Refused(f"{where}: {name!r} is not a checkpoint name (one path part, no '/')")
    return name
