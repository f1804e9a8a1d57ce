"""The planner's cost model: one RL step's time and memory for a group of colocated models.

A step is four stages (the paper's §6): ``generate`` (the actor samples responses in its
generation layout), ``prepare`` (forward passes: the actor's old log-probs unless the
generator's are used, the reference's log-probs, the critic's values, the reward model's scores),
``train`` (the actor's and critic's updates, ``ppo_epochs`` passes of forward + backward) and
``sync`` (the actor's weights from its training layout to its generation layout, reshard/).
Models in one group run one after another, so a group's stage time is the sum of its models';
groups run in parallel, so a stage costs its slowest group; the step costs the sum of its stages.

Per model, with ``n`` devices in the group laid out as ``p`` pipeline x ``t`` tensor x ``d``
data parallel (one ``(p, t)`` per group: a placement group has one tp and one pp for all its
roles, ``controller/placement.py``):

- **compute-bound passes** (prefill, prepare, train): FLOPs = 2 x non-embedding params x tokens
  + causal attention 2 x 2 x L x A x tokens x seq / 2 + the output head 2 x h x V x tokens;
  training is 3x a forward. Time = FLOPs / (n x flops), stretched by the pipeline bubble
  (m + p - 1) / m for m = micro-batches per dp replica, plus tensor-parallel all-reduces (2 per
  layer and micro-batch in a forward, 4 when training) of the micro-batch's activations,
  pipeline sends of each micro-batch's activations (and gradients) between stages, a dp
  gradient all-reduce per optimizer step, and ``op_latency_s`` per layer and micro-batch. A
  model whose dp is FSDP (``Workload.fsdp``: the fsdp engine's default ``dp_mode``) also
  all-gathers each layer's weights per micro-batch, once in a forward and again in a backward;
  Megatron's dp (and ``dp_mode: replicate``) does not;
- **generation** (memory-bound): each decode step reads the generation shard's weights and the
  KV cache of the sequences in flight; a step costs max(bytes / mem_bw, FLOPs / flops) plus
  ``L`` x ``op_latency_s`` and two latency-bound all-reduces per layer at gen tp > 1. Sequences
  in flight per replica are capped by the memory left after every resident model state; the
  rest waits for another wave;
- **memory** per device: trained models hold bf16 weights and gradients (4 B/param) plus fp32
  master weights and Adam moments sharded over dp (12 B/param / d), all / (p x t); inference
  models hold bf16 weights / (p x t). On top, the largest transient of any stage: training
  activations 34 x seq x h x L / t bytes per in-flight sequence (Korthikanti et al. 2022), or the
  actor's generation weights beyond its training shard plus the KV cache;
- **sync**: the bytes HybridFlow's reshard moves per device (``reshard.plan.table_bytes``, the
  paper's Table 2) over the group's bandwidth.

Bandwidth: ``intra_bw`` when the devices of a collective fit in one node (``per_node``), else
``inter_bw``. Everything an estimate uses is in ``deploy/plan/profiles.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from deploy.plan.profiles import DeviceProfile
from reshard.layout import GenLayout, Layout
from reshard.plan import table_bytes
from reshard.shapes import LlamaDims

STAGES = ("generate", "prepare", "train", "sync")
TRAINED = ("actor", "critic", "cost_critic")
WEIGHT_BYTES = 2  # bf16 weights for compute and for generation
ACTIVATION_BYTES = 34  # per token, hidden unit and layer, without recomputation


@dataclass(frozen=True)
class ModelShape:
    dims: LlamaDims

    @property
    def attn(self) -> int:
        return self.dims.heads * self.dims.head_size

    @property
    def kv(self) -> int:
        return self.dims.kv_heads * self.dims.head_size

    @property
    def block_params(self) -> int:
        d = self.dims
        per_layer = d.hidden * (2 * self.attn + 2 * self.kv) + 3 * d.hidden * d.intermediate
        return d.layers * per_layer

    @property
    def params(self) -> int:
        d = self.dims
        embeddings = d.vocab * d.hidden * (1 if d.tied else 2)
        return self.block_params + embeddings

    def forward_flops(self, tokens: float, seq: float) -> float:
        d = self.dims
        attention = 2 * 2 * d.layers * self.attn * tokens * seq / 2
        return 2 * self.block_params * tokens + attention + 2 * d.hidden * d.vocab * tokens

    def kv_bytes_per_token(self) -> float:
        return 2 * self.dims.layers * self.kv * WEIGHT_BYTES


@dataclass(frozen=True)
class Workload:
    """One RL step: which role holds which model, and how much work each stage is."""

    models: Mapping[str, ModelShape]  # roles with a model (rule rewards have none)
    rows: int  # sequences per step (prompts x samples)
    prompt_len: int
    response_len: int
    epochs: int = 1  # passes of forward + backward over the batch per trained model
    optimizer_steps: int = 1  # per trained model per step (ppo_epochs x mini_batches)
    recompute_old: bool = True  # the actor recomputes pi_old in prepare
    micro_batch: int = 1  # sequences per micro-batch in forward / backward passes
    generator: str = "actor"
    fsdp: frozenset[str] = frozenset()  # roles whose dp all-gathers weights per layer (FSDP)

    @property
    def seq(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def trained(self) -> list[str]:
        return [r for r in self.models if r in TRAINED]

    def prepared(self) -> list[str]:
        """Roles with a forward pass in ``prepare``."""
        return [r for r in self.models if r != self.generator or self.recompute_old]


@dataclass(frozen=True)
class Strategy:
    p: int
    t: int
    d: int
    gen_t: int


@dataclass
class GroupCost:
    strategy: Strategy
    stages: dict[str, float]
    memory: float  # peak bytes per device
    fits: bool
    waves: int = 1
    detail: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.stages.values())


def _bw(devices: int, per_node: int, profile: DeviceProfile) -> float:
    return profile.intra_bw if devices <= per_node else profile.inter_bw


def all_reduce_s(nbytes: float, ranks: int, bw: float, profile: DeviceProfile) -> float:
    """Ring all-reduce of ``nbytes`` over ``ranks``."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bw + profile.collective_latency_s


def pass_s(
    m: ModelShape,
    wl: Workload,
    s: Strategy,
    per_node: int,
    profile: DeviceProfile,
    backward: bool,
    fsdp: bool = False,
) -> float:
    """Forward (and backward) over the step's sequences on ``p x t x d`` devices."""
    n = s.p * s.t * s.d
    factor = 3 if backward else 1
    tokens = wl.rows * wl.seq
    compute = factor * m.forward_flops(tokens, wl.seq) / (n * profile.flops)
    micro = max(1.0, math.ceil(wl.rows / s.d / wl.micro_batch))  # micro-batches per replica
    bubble = (micro + s.p - 1) / micro
    tp_bytes = wl.micro_batch * wl.seq * m.dims.hidden * WEIGHT_BYTES
    tp_calls = micro * (2 if backward else 1) * 2 * m.dims.layers / s.p
    tp = tp_calls * all_reduce_s(tp_bytes, s.t, _bw(s.t, per_node, profile), profile)
    gather = 0.0
    if fsdp and s.d > 1:  # each layer's weights, per micro-batch (and again for its backward)
        units = m.dims.layers / s.p + 1  # the decoder layers and the root (embeddings, head)
        nbytes = WEIGHT_BYTES * m.params / (s.p * s.t) / units
        one = (s.d - 1) / s.d * nbytes / _bw(s.p * s.t * s.d, per_node, profile)
        gather = micro * (2 if backward else 1) * units * (one + profile.collective_latency_s)
    latency = factor * micro * m.dims.layers / s.p * profile.op_latency_s
    # pipeline: each micro-batch's activations (and, training, their gradients) cross each of
    # a device's stage boundaries; over nodes once a pipeline spans more than one
    p2p = 0.0
    if s.p > 1:
        per_micro = wl.micro_batch * wl.seq * m.dims.hidden * WEIGHT_BYTES / s.t
        sends = micro * (2 if backward else 1)
        p2p = sends * (per_micro / _bw(s.p * s.t, per_node, profile) + profile.collective_latency_s)
    # the engine's own small all-reduces over dp per call (micro-batch counts, token counts,
    # metric sums: 3 for a training step, 1 for a forward, roles/engines/training/fsdp.py)
    agree = (3 if backward else 1) * profile.collective_latency_s if s.d > 1 else 0.0
    return compute * bubble + tp + gather + latency + p2p + agree


def train_s(
    m: ModelShape,
    wl: Workload,
    s: Strategy,
    per_node: int,
    profile: DeviceProfile,
    fsdp: bool = False,
) -> float:
    passes = wl.epochs * pass_s(m, wl, s, per_node, profile, backward=True, fsdp=fsdp)
    grads = WEIGHT_BYTES * m.params / (s.p * s.t)
    n = s.p * s.t * s.d
    reduce = all_reduce_s(grads, s.d, _bw(n, per_node, profile), profile)
    return passes + wl.optimizer_steps * reduce


def state_bytes(m: ModelShape, trained: bool, s: Strategy) -> float:
    per_param = (4 + 12 / s.d) if trained else WEIGHT_BYTES
    return per_param * m.params / (s.p * s.t)


def activation_bytes(m: ModelShape, wl: Workload, s: Strategy) -> float:
    """Training activations of the sequences in flight on one device (1F1B keeps p of them
    on the first stage, each holding L/p layers: L layers' worth in all)."""
    return ACTIVATION_BYTES * wl.micro_batch * wl.seq * m.dims.hidden * m.dims.layers / s.t


def generate_s(
    m: ModelShape,
    wl: Workload,
    s: Strategy,
    free: float,
    per_node: int,
    profile: DeviceProfile,
) -> tuple[float, int, float]:
    """Seconds to generate the step's responses at generation tp ``s.gen_t`` (pipeline 1), the
    waves needed, and the extra bytes the generation shard takes beyond the training shard.
    ``free``: bytes per device left after every resident state. inf seconds if it cannot fit."""
    n = s.p * s.t * s.d
    gen_d = n // s.gen_t
    shard = WEIGHT_BYTES * m.params / s.gen_t
    extra = max(0.0, shard - WEIGHT_BYTES * m.params / (s.p * s.t))
    per_seq = m.kv_bytes_per_token() / s.gen_t * wl.seq
    room = free - extra
    if room < per_seq:
        return math.inf, 0, extra
    rows = math.ceil(wl.rows / gen_d)
    flight = max(1, min(rows, int(room // per_seq)))
    waves = math.ceil(rows / flight)
    context = wl.prompt_len + wl.response_len / 2
    step_bytes = shard + flight * m.kv_bytes_per_token() / s.gen_t * context
    step_flops = m.forward_flops(flight, context) / s.gen_t
    decode = max(step_bytes / profile.mem_bw, step_flops / profile.flops)
    decode += m.dims.layers * profile.op_latency_s
    if s.gen_t > 1:
        small = flight * m.dims.hidden * WEIGHT_BYTES
        decode += (
            2
            * m.dims.layers
            * all_reduce_s(small, s.gen_t, _bw(s.gen_t, per_node, profile), profile)
        )
    prefill = m.forward_flops(flight * wl.prompt_len, wl.prompt_len) / (s.gen_t * profile.flops)
    return waves * (wl.response_len * decode + prefill), waves, extra


def sync_s(m: ModelShape, s: Strategy, per_node: int, profile: DeviceProfile) -> float:
    if s.gen_t == s.t and s.p == 1:
        return 0.0
    moved = table_bytes(
        "hybridflow",
        Layout(dp=s.d, tp=s.t, pp=s.p),
        GenLayout(tp=s.gen_t, pp=1),
        WEIGHT_BYTES * m.params,
    )
    return moved / _bw(s.p * s.t, per_node, profile) + profile.collective_latency_s


def group_cost(
    roles: list[str], wl: Workload, s: Strategy, per_node: int, profile: DeviceProfile
) -> GroupCost:
    """The stages of the roles in one group under one strategy, and whether they fit."""
    models = {r: wl.models[r] for r in roles if r in wl.models}
    resident = sum(state_bytes(m, r in TRAINED, s) for r, m in models.items())
    stages = dict.fromkeys(STAGES, 0.0)
    transient = 0.0
    for r, m in models.items():
        fsdp = r in wl.fsdp
        if r in wl.prepared():
            stages["prepare"] += pass_s(m, wl, s, per_node, profile, False, fsdp)
        if r in TRAINED:
            stages["train"] += train_s(m, wl, s, per_node, profile, fsdp)
            transient = max(transient, activation_bytes(m, wl, s))
    waves = 1
    if wl.generator in models:
        m = models[wl.generator]
        seconds, waves, extra = generate_s(
            m, wl, s, profile.mem_bytes - resident, per_node, profile
        )
        stages["generate"] = seconds
        stages["sync"] = sync_s(m, s, per_node, profile)
        transient = max(transient, extra + m.kv_bytes_per_token() / s.gen_t * wl.seq)
    memory = resident + transient
    fits = memory <= profile.mem_bytes and math.isfinite(stages["generate"])
    return GroupCost(s, stages, memory, fits, waves)


def step_cost(costs: list[GroupCost]) -> dict[str, float]:
    """Per stage the slowest group; ``total`` their sum."""
    found = {stage: max(c.stages[stage] for c in costs) for stage in STAGES}
    found["total"] = sum(found[s] for s in STAGES)
    return found
