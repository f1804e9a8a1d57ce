"""The actor and reference roles: a causal LM that scores tokens, and (actor) learns.

Both compute per-token log-probs with the definition in ``roles/modeling/logprob.py``. The reference is a
frozen copy; the actor also trains — by PPO-style policy updates for RL and by next-token loss for
supervised fine-tuning. All batch endpoints are dp-split: the controller's batch is sharded over
the group's data-parallel ranks. Checkpoints and export come from ``EngineRole``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch

from roles.base import RoleContext
from roles.engine_role import EngineRole
from roles.engines.generation.serve import make_engine, serve
from roles.engines.generation.sessions import SessionCache
from roles.engines.generation.vllm import VLLMEngine
from roles.engines.hybrid import HybridEngine, optimizer_offloaded
from roles.engines.training.interface import LossFn
from roles.modeling.logprob import read_columns, token_entropy, token_log_probs
from roles.modeling.lora import merged_state
from roles.modeling.losses import aggregate, policy_loss
from roles.modeling.models import load_tokenizer
from roles.modeling.text import encode_rows
from roles.runtime.device import peak_memory_bytes, reset_peak_memory
from roles.runtime.endpoint import DP_REDUCED, DP_SPLIT, MICRO_DP, ONE_TO_ALL, endpoint
from transport.batch import TensorBatch
from transport.columns import (
    ADVANTAGES,
    ATTENTION_MASK,
    ENTROPY,
    IDLE,
    INPUT_IDS,
    LOG_PROBS,
    MESSAGES,
    OLD_LOG_PROBS,
    PROMPT,
    RATIO_MASK,
    REF_LOG_PROBS,
    RESPONSE,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TOKENS,
    WEIGHTS,
)
from transport.protocol import PEAK_MEMORY
from transport.sampling import SamplingConfig
from transport.training import AdamStep, PolicyLossConfig, Reduction


class Reference(EngineRole):
    """Frozen causal LM: log-probs of given tokens."""

    frozen = True

    def __init__(self, ctx: RoleContext, **config: Any) -> None:
        super().__init__(ctx, **config)
        self.tokenizer = load_tokenizer(self.engine.cfg.model)

    @endpoint(DP_SPLIT)
    def compute_log_prob(
        self, batch: TensorBatch, temperature: float = 1.0, entropy: bool = False
    ) -> TensorBatch:
        """``log_probs`` (and ``entropy``) ``[B, T]`` aligned with ``input_ids``. With a
        ``response_mask``, each row's columns before its first response token hold 0: the
        engine computes logits only where responses are read (``logits_at``)."""
        return self._log_probs(batch, temperature, entropy)

    def _log_probs(self, batch: TensorBatch, temperature: float, entropy: bool) -> TensorBatch:
        batch.require_tensors(INPUT_IDS, ATTENTION_MASK)

        def read(logits: torch.Tensor, micro: TensorBatch) -> torch.Tensor:
            mask = read_columns(micro.tensor(ATTENTION_MASK), micro.tensors.get(RESPONSE_MASK))
            logp = token_log_probs(logits, micro.tensor(INPUT_IDS), temperature) * mask
            if not entropy:
                return logp
            width = int(mask.shape[1])
            return torch.stack([logp, token_entropy(logits, temperature, width) * mask], dim=-1)

        out = self.engine.infer(batch, read)
        if entropy:
            return TensorBatch.from_dict({LOG_PROBS: out[..., 0], ENTROPY: out[..., 1]})
        return TensorBatch.from_dict({LOG_PROBS: out})


class Teacher(Reference):
    """On-policy distillation's teacher: a frozen model, of any size, with the student's
    tokenizer, whose log-probs of the student's sampled tokens are the training signal
    (``controller/algorithms.py``: ``distill_step``). Nothing trains or re-bases it, so a restart
    loses nothing (its weights come from its model folder)."""


class Actor(Reference):
    """The policy: log-probs, PPO updates, supervised fine-tuning, checkpoints and export."""

    frozen = False

    def __init__(self, ctx: RoleContext, **config: Any) -> None:
        super().__init__(ctx, **config)
        self.hybrid: HybridEngine | None = None
        self.vllm: VLLMEngine | None = None  # generator vllm: built by the first generate
        cfg = self.engine.cfg
        self.sessions = SessionCache(int(cfg.session_cache_mb * 2**20))
        if self.engine.cfg.lora is not None and ctx.layout.resharded:
            raise ValueError(
                f"lora: the actor generates at its training layout with adapters; placement "
                f"gen_tp={ctx.layout.generation_tp} / gen_pp={ctx.layout.generation_pp} reshards, "
                "which does not carry LoRA layers yet - drop gen_tp and gen_pp"
            )
        if self.engine.cfg.generator == "vllm":
            if not self.engine.generates_in_place:  # vLLM reads the weights from full_weights
                raise ValueError(
                    f"generator 'vllm' takes the weights of a Hugging Face module; backend "
                    f"{self.engine.cfg.backend!r} generates through reshard with 'native'"
                )
            _check_vllm_layout(ctx.layout.resharded, ctx.layout.generation_tp, ctx.layout.pp)
        elif ctx.layout.resharded or not self.engine.generates_in_place:
            # the group generates at another layout (placement gen_tp / gen_pp), or its engine
            # holds no module a generator runs (megatron): through reshard
            if self.engine.cfg.generator != "native":
                raise ValueError(
                    f"gen_tp={ctx.layout.generation_tp} (or backend: "
                    f"{self.engine.cfg.backend}) runs the native generator; "
                    f"got generator={self.engine.cfg.generator!r}"
                )
            if ctx.layout.resharded:  # else built by the first generate: many never generate
                self.hybrid = self._hybrid()

    @endpoint(DP_SPLIT)
    def compute_ref_log_prob(
        self, batch: TensorBatch, temperature: float = 1.0, entropy: bool = False
    ) -> TensorBatch:
        """``compute_log_prob`` of the reference of a LoRA run, this actor itself (no second copy
        of the model is loaded): its adapters switched off (the base model), or once
        ``rebase_reference`` ran, the adapters it froze."""
        with self.engine.reference_weights():
            return self._log_probs(batch, temperature, entropy)

    @endpoint(ONE_TO_ALL)
    def rebase_reference(self) -> None:
        """The adapters as they are now become the reference's (``compute_ref_log_prob``), at
        an RL stage's start after an earlier stage trained them: the KL is then measured from
        the model the stage starts from, as with a separate reference role."""
        self.engine.rebase_reference()

    def _hybrid(self) -> HybridEngine:
        bucket = int(self.engine.cfg.reshard_bucket_mb * 1e6)
        return HybridEngine(self.engine, self.ctx.layout, bucket)

    def _generation_weights(self) -> AbstractContextManager[torch.nn.Module]:
        if self.hybrid is None and not self.engine.generates_in_place:
            self.hybrid = self._hybrid()  # a collective: every rank generates
        return self.hybrid.weights() if self.hybrid else self.engine.full_weights()

    @endpoint(MICRO_DP)
    def generate(
        self, batch: TensorBatch, sampling: SamplingConfig | None = None, min_version: int = 0
    ) -> TensorBatch:
        """Colocated generation, the same call a rollout group takes. The actor always samples
        from its newest weights: ``min_version`` is the policy version the controller counts
        them at (``controller/rollouts.py``), and ``meta["weight_version"]`` reports it.

        At the training layout on the actor's own weights: at one
        rank, replicate mode or pure tp nothing is copied; under FSDP every layer is gathered
        first and freed after (``meta["gather_s"]`` says how long that took). With a generation
        tp (placement ``gen_tp``) the weights are resharded to it for the call
        (``roles/engines/hybrid.py``) and the batch is split over the d * d_g replicas. With
        ``generator: vllm`` see ``_generate_vllm``."""
        reset_peak_memory(self.ctx.device)
        if self.engine.cfg.generator == "vllm":
            out = self._generate_vllm(batch, sampling, min_version)
            out.meta[PEAK_MEMORY] = peak_memory_bytes(self.ctx.device)
            return out
        start = time.perf_counter()
        offload = (
            getattr(self.engine, "optimizer", None) if self.engine.cfg.offload_optimizer else None
        )
        with optimizer_offloaded(offload) as offloaded, self._generation_weights() as module:
            gathered = time.perf_counter() - start
            engine = make_engine(self.engine.cfg.generator, module, self.tokenizer)
            with self.engine.autocast():
                out = serve(engine, self.tokenizer, batch, sampling, min_version, self.sessions)
        out.meta["gather_s"] = gathered
        out.meta["offloaded_bytes"] = offloaded
        if self.hybrid is not None:
            out.meta.update(self.hybrid.last)  # reshard_s, reshard_recv_bytes
        out.meta[PEAK_MEMORY] = peak_memory_bytes(self.ctx.device)
        return out

    @endpoint(ONE_TO_ALL)
    def drop_sessions(self, keys: list[str]) -> int:
        """Forget the kept KV of these trajectories (they ended); how many this rank held."""
        return self.sessions.drop(keys)

    def _generate_vllm(
        self, batch: TensorBatch, sampling: SamplingConfig | None, version: int
    ) -> TensorBatch:
        """Colocated generation through vLLM (``roles/engines/generation/vllm.py``): the actor's
        whole weights are reloaded into vLLM in place (``meta["gather_s"]``), it generates, and
        then its KV cache and weights are freed until the next call (``meta["released_bytes"]``):
        between generations the actor holds one copy of the weights, as with the native engine."""
        start = time.perf_counter()
        offload = (
            getattr(self.engine, "optimizer", None) if self.engine.cfg.offload_optimizer else None
        )
        engine = self._vllm_engine()
        with optimizer_offloaded(offload) as offloaded:
            with self.engine.full_weights() as module:
                lora = self.engine.cfg.lora
                # vLLM runs no adapters here: it takes W0 + s·BA, merged from the pristine base
                engine.load_weights(
                    whole_weights(module) if lora is None else merged_weights(module, lora.scaling)
                )
            loaded = time.perf_counter() - start
            out = serve(engine, self.tokenizer, batch, sampling, version)
            released = engine.release(weights=True)
        out.meta.update(gather_s=loaded, offloaded_bytes=offloaded, released_bytes=released)
        return out

    def _vllm_engine(self) -> VLLMEngine:
        if self.vllm is None:
            self.vllm = VLLMEngine(
                self.engine.cfg.model,
                tp=self.ctx.layout.generation_tp,
                dtype=torch.bfloat16 if self.engine.precision.dtype == "bf16" else torch.float32,
                eos_token_id=self.tokenizer.eos_token_id,
                context=int(self.engine.model_config.max_position_embeddings),
                load_from_dir=False,  # the weights come from the actor before every generate
            )
        return self.vllm

    @endpoint(ONE_TO_ALL)
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights (from rank 0), e.g. for a rollout group's ``load_weights``."""
        return self.engine.full_state()

    @endpoint(DP_REDUCED)
    def update_policy(
        self, batch: TensorBatch, loss: PolicyLossConfig | None = None, temperature: float = 1.0
    ) -> dict[str, float]:
        """One optimizer step of the clipped surrogate on the whole batch. Needs ``input_ids``,
        ``attention_mask``, ``response_mask``, ``old_log_probs``, ``advantages`` (and
        ``ref_log_probs`` when ``loss.kl_coef`` > 0, ``rollout_log_probs``, the generator's,
        when ``loss.tis_cap`` or ``loss.decoupled`` is set). ``loss`` None: the defaults (a
        controller that sends the fields as a map still works)."""
        loss_fn = self._policy_loss_fn(batch, loss, temperature)
        reset_peak_memory(self.ctx.device)
        result = self.engine.train_step(batch, loss_fn)
        result[PEAK_MEMORY] = float(peak_memory_bytes(self.ctx.device))
        return result

    @endpoint(DP_REDUCED)
    def forward_backward(
        self,
        batch: TensorBatch,
        loss: PolicyLossConfig | None = None,
        temperature: float = 1.0,
        reduction: Reduction = "mean",
    ) -> dict[str, float]:
        """``update_policy``'s forward and backward without the optimizer step: the gradients
        add to those of earlier calls until ``optim_step``. ``reduction`` "mean": each call's
        loss normalised by its own batch's tokens or responses (as ``loss.agg`` says); "sum":
        not normalised, so calls on parts add up to one call on the whole (Tinker's losses)."""
        return self.engine.forward_backward(
            batch, self._trained_fn(batch, loss, temperature, reduction)
        )

    @endpoint(DP_SPLIT)
    def forward_backward_kept(
        self,
        batch: TensorBatch,
        loss: PolicyLossConfig | Literal["cross_entropy"],
        temperature: float = 1.0,
        reduction: Reduction = "mean",
    ) -> TensorBatch:
        """``forward_backward`` (a policy loss) or ``forward_backward_nll`` (``"cross_entropy"``,
        at temperature 1) that also returns the log-probs its loss saw, from the same forward:
        ``log_probs`` ``[B, T]`` aligned with ``input_ids``, and the call's metrics (summed over
        data-parallel ranks) in ``meta["metrics"]``."""
        if loss == "cross_entropy":
            fn, temperature = self._nll_fn(batch, reduction), 1.0
        else:
            fn = self._trained_fn(batch, loss, temperature, reduction)
        width = int(batch.tensor(INPUT_IDS).shape[1])
        kept: list[torch.Tensor] = []

        def keeping(
            logits: torch.Tensor, micro: TensorBatch, tokens: float, seqs: float
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            with torch.no_grad():
                logp = token_log_probs(logits.detach(), micro.tensor(INPUT_IDS), temperature)
            kept.append(torch.nn.functional.pad(logp.float(), (0, width - int(logp.shape[1]))))
            return fn(logits, micro, tokens, seqs)

        metrics = self.engine.forward_backward(batch, keeping)
        real = -(-len(batch) // self.engine.cfg.micro_batch_size)  # the padding ones come last
        log_probs = torch.cat(kept[:real]) * batch.tensor(RESPONSE_MASK)
        return TensorBatch({LOG_PROBS: log_probs}, {}, {"metrics": metrics})

    def _trained_fn(
        self,
        batch: TensorBatch,
        loss: PolicyLossConfig | None,
        temperature: float,
        reduction: Reduction,
    ) -> LossFn:
        loss_fn = self._policy_loss_fn(batch, loss, temperature)
        cfg = PolicyLossConfig.model_validate(loss if loss is not None else {})
        return reduced(loss_fn, cfg.agg, reduction)

    @endpoint(DP_REDUCED)
    def forward_backward_nll(
        self, batch: TensorBatch, reduction: Reduction = "mean"
    ) -> dict[str, float]:
        """Cross-entropy's forward and backward on token rows: the next-token loss of the
        tokens ``response_mask`` marks, each times its ``weights`` column when there is one, over
        the batch's marked tokens (``loss``; ``reduction`` as ``forward_backward``'s); the
        gradients add up until ``optim_step``."""
        return self.engine.forward_backward(batch, self._nll_fn(batch, reduction))

    def _nll_fn(self, batch: TensorBatch, reduction: Reduction) -> LossFn:
        batch.require_tensors(*TOKENS)

        def loss_fn(
            logits: torch.Tensor, micro: TensorBatch, tokens: float, seqs: float
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            nll = -token_log_probs(logits, micro.tensor(INPUT_IDS))
            weights = micro.tensors.get(WEIGHTS)
            if weights is not None:
                nll = nll * weights
            return aggregate(nll, micro.tensor(RESPONSE_MASK), "token-mean", tokens, seqs), {}

        return reduced(loss_fn, "token-mean", reduction)

    @endpoint(ONE_TO_ALL)
    def optim_step(self, adam: AdamStep | None = None) -> dict[str, float]:
        """One optimizer step on what ``forward_backward`` accumulated (``adam``: this step's
        own AdamW settings); ``grad_norm`` (before clipping) and ``lr``."""
        return self.engine.optim_step(adam)

    def _policy_loss_fn(
        self, batch: TensorBatch, loss: PolicyLossConfig | None, temperature: float
    ) -> LossFn:
        cfg = PolicyLossConfig.model_validate(loss if loss is not None else {})
        needed = [OLD_LOG_PROBS, ADVANTAGES] + ([REF_LOG_PROBS] if cfg.kl_coef else [])
        needed += [ROLLOUT_LOG_PROBS] if cfg.behaviour_cap is not None else []
        batch.require_tensors(*TOKENS, *needed)

        def loss_fn(
            logits: torch.Tensor, micro: TensorBatch, tokens: float, seqs: float
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            ids = micro.tensor(INPUT_IDS)
            return policy_loss(
                token_log_probs(logits, ids, temperature),
                micro.tensor(OLD_LOG_PROBS),
                micro.tensor(ADVANTAGES),
                micro.tensor(RESPONSE_MASK),
                cfg,
                tokens,
                seqs,
                entropy=token_entropy(logits, temperature, int(ids.shape[1]))
                if cfg.entropy_coef
                else None,
                ref_logp=micro.tensors.get(REF_LOG_PROBS) if cfg.kl_coef else None,
                rollout_logp=micro.tensors.get(ROLLOUT_LOG_PROBS),
                ratio_mask=micro.tensors.get(RATIO_MASK),
            )

        return loss_fn

    def _sft_batch(
        self, batch: TensorBatch, response_only: bool, pack: bool
    ) -> tuple[TensorBatch, int]:
        prompts, responses = batch.non_tensor(PROMPT), batch.non_tensor(RESPONSE)
        conversations = batch.non_tensors.get(MESSAGES)
        limit = int(self.engine.model_config.max_position_embeddings)
        idle = batch.tensors.get(IDLE)  # copies that keep a dp rank busy: they train on nothing
        return encode_rows(
            self.tokenizer,
            prompts,
            responses,
            limit,
            response_only,
            pack,
            conversations,
            None if idle is None else idle.bool().tolist(),
        )

    @endpoint(DP_REDUCED)
    def sft_step(
        self,
        batch: TensorBatch,
        response_only: bool = True,
        pack: bool = False,
        scale: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer step of token-mean next-token loss on text rows (``prompt``,
        ``response``, or per row a conversation in a ``messages`` column: then only assistant
        tokens count, ``roles/modeling/text.py``); with ``response_only`` the prompt tokens are
        not trained on; ``pack`` packs each rank's rows into as few context-long rows as fit.
        ``scale`` multiplies the loss (a pretraining term's coefficient, e.g. Safe-RLHF's ptx)."""
        tokens_batch, cut = self._sft_batch(batch, response_only, pack)

        def loss_fn(
            logits: torch.Tensor, micro: TensorBatch, tokens: float, seqs: float
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss, metrics = _nll(logits, micro, tokens, seqs)
            return loss * scale, metrics

        metrics = self.engine.train_step(tokens_batch, _nll if scale == 1.0 else loss_fn)
        metrics["truncated"] = self.sum_over_dp({"cut": torch.tensor(float(cut))})["cut"]
        return metrics

    @endpoint(DP_REDUCED)
    def sft_eval(
        self, batch: TensorBatch, response_only: bool = True, pack: bool = False
    ) -> dict[str, float]:
        """Token-mean next-token loss on text rows, no update (held-out loss)."""
        tokens_batch, _ = self._sft_batch(batch, response_only, pack)

        def read(logits: torch.Tensor, micro: TensorBatch) -> torch.Tensor:
            nll = -token_log_probs(logits, micro.tensor(INPUT_IDS)) * micro.tensor(RESPONSE_MASK)
            return nll.sum(-1)

        mask = tokens_batch.tensor(RESPONSE_MASK)
        totals = {"nll": self.engine.infer(tokens_batch, read).sum(), "tokens": mask.sum().float()}
        summed = self.sum_over_dp(totals)
        return {"loss": summed["nll"] / max(summed["tokens"], 1.0), "tokens": summed["tokens"]}


def _check_vllm_layout(resharded: bool, gen_tp: int, pp: int) -> None:
    """vLLM cuts the group into tp groups of consecutive ranks: the training tp groups (gen_tp =
    tp) or single ranks (gen_tp = 1); the hybrid engine's groupings in between are not its."""
    if pp != 1 or (resharded and gen_tp != 1):
        raise ValueError(
            f"generator 'vllm' generates at gen_tp = tp or gen_tp = 1 with pp = 1; got "
            f"gen_tp={gen_tp}, pp={pp} (use generator 'native' for other layouts)"
        )


def whole_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter whole (tp-split DTensors gathered, one at a time), by name."""
    from torch.distributed.tensor import DTensor

    for name, param in module.named_parameters():
        yield name, param.full_tensor() if isinstance(param, DTensor) else param.detach()


def merged_weights(module: torch.nn.Module, scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight in plain Hugging Face names with the LoRA adapters merged in."""
    params = {name: param.detach() for name, param in module.named_parameters()}
    yield from merged_state(params, scaling).items()


def _nll(
    logits: torch.Tensor, micro: TensorBatch, tokens: float, seqs: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    nll = -token_log_probs(logits, micro.tensor(INPUT_IDS))
    return aggregate(nll, micro.tensor(RESPONSE_MASK), "token-mean", tokens, seqs), {}


def reduced(loss_fn: LossFn, agg: str, reduction: Reduction) -> LossFn:
    """``loss_fn`` as it is ("mean"), or with its loss times the count it was normalised by
    ("sum": the batch's tokens for ``token-mean``, its responses otherwise), so each term counts
    once whatever call it came in; the metrics stay means."""
    if reduction == "mean":
        return loss_fn
    if reduction != "sum":
        raise ValueError(f"reduction={reduction!r}: use 'mean' or 'sum'")

    def summed(
        logits: torch.Tensor, micro: TensorBatch, tokens: float, seqs: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = loss_fn(logits, micro, tokens, seqs)
        return loss * (tokens if agg == "token-mean" else seqs), metrics

    return summed
