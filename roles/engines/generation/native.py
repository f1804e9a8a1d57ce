"""The ``native`` generation engine: a batched KV-cache sampler over a Hugging Face Llama-family
model's own modules (embeddings, attention projections, MLP, norms, rotary tables).

Where the time goes in generation on a CPU, and what this engine does about it:

* **prefill without padding** — every distinct prompt is packed into one sequence (one pass
  through the projections and MLPs for the whole batch, no pad tokens; attention runs per
  prompt), and a prompt sampled ``n`` times is prefilled once;
* **finished samples leave the batch** — the caches are compacted whenever a quarter of the rows
  have finished, so the remaining steps only compute live rows;
* **no per-step framework overhead** — one preallocated cache per layer, attention over the
  longest live row only, no generation-config machinery;
* **sessions** — a multi-turn trajectory's keys and values are kept between its turns
  (``sessions.py``): a turn prefills only what follows the kept prefix (its observation).

Sampling is per sample: each draws its uniforms from its own generator (seeded from the request
seed, the request index and the sample index), so a sample's tokens do not depend on the batch it
ran in; a continued sample (``Resume``) picks its stream up where it left off, so a response
generated in chunks is the one-call response (when the weights stay the same). The reported log-probs follow ``roles/modeling/logprob.py``. With tensor parallel (the model's
projections split by ``roles/engines/training/fsdp.py``'s plan), each rank runs the same loop on its heads;
the row-parallel projections all-reduce, so every rank samples the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from roles.engines.generation.interface import (
    GenerationEngine,
    GenerationError,
    LogitsProcessor,
    Resume,
    Sample,
    SamplingConfig,
    check_prompts,
    sample_seed,
)
from roles.engines.generation.sessions import Session, SessionRequest
from roles.modeling.lora import effective_weight, is_lora_layer
from roles.modeling.text import segment_positions
from transport.device import in_host_memory

COMPACT_FRACTION = 0.25  # compact the caches once this share of the rows has finished
#: decode steps between the host's looks at the live rows when the weights are on an
#: accelerator (each look waits for the device; finished rows compute until the next one)
ACCELERATOR_CHECK_EVERY = 16


class NativeEngine(GenerationEngine):
    def __init__(
        self,
        model: Any,
        eos_token_id: int,
        check_every: int | None = None,
        lora_at_runtime: bool = False,
    ) -> None:
        """``check_every``: decode steps between the host's looks at which samples are still
        live (to stop early and to compact the caches). Each look is one device-to-host
        synchronisation; on the host itself it costs nothing, so ``None`` means every step on
        the host and every ``ACCELERATOR_CHECK_EVERY`` steps on an accelerator.

        A model with LoRA layers (``roles/modeling/lora.py``) generates with each adapted
        weight merged per call, ``W0 + s·BA`` from the untouched base, into the fused matrices
        this engine builds anyway; ``lora_at_runtime`` instead runs PEFT's layers as modules
        (``x W0ᵀ + s·(x Aᵀ) Bᵀ`` at every step; ``python -m bench.lora`` times both)."""
        if check_every is not None and check_every < 1:
            raise GenerationError(f"check_every must be >= 1, got {check_every}")
        self.model = model
        self.base = getattr(model, str(model.base_model_prefix))
        weights = _local(self.base.embed_tokens.weight)
        self.device = weights.device  # where the weights are; every tensor of a call goes there
        if check_every is None:
            check_every = 1 if in_host_memory(weights) else ACCELERATOR_CHECK_EVERY
        self.check_every = check_every
        config = model.config
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.context = int(config.max_position_embeddings)
        self.eos = eos_token_id
        self.lora_at_runtime = lora_at_runtime

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        processor: LogitsProcessor | None = None,
        request_seeds: Sequence[int] | None = None,
        resume: Sequence[Resume] | None = None,
        sessions: SessionRequest | None = None,
    ) -> list[Sample]:
        """As ``GenerationEngine.generate``; ``sessions`` (with ``n = 1``) names each prompt's
        session: its kept prefix is not prefilled again, and its state after this call is kept."""
        check_prompts(prompts, sampling, self.context, resume)
        if sessions is not None and sampling.n != 1:
            raise GenerationError(
                f"sessions need n = 1 (one sample per prompt), got n = {sampling.n}"
            )
        self._fuse()
        n, steps = sampling.n, sampling.max_new_tokens
        past = self._take_sessions(prompts, sessions)
        requests = [i for i in range(len(prompts)) for _ in range(n)]  # per sample
        uniforms = torch.stack(
            [
                self._uniforms(sampling, request_seeds, request, j % n, resume)
                for j, request in enumerate(requests)
            ]
        ).to(self.device)
        stops = torch.tensor(sampling.stop_token_ids or [self.eos], device=self.device)
        caches, lengths, logits = self._prefill(prompts, n, steps, past)
        # What the loop produces stays on the device: one column per step, and each sample's
        # length (steps + 1 = still live). The host looks every ``check_every`` steps.
        out_tokens = torch.zeros((len(requests), steps), dtype=torch.long, device=self.device)
        out_log_probs = torch.zeros((len(requests), steps), device=self.device)
        produced = torch.full((len(requests),), steps + 1, dtype=torch.long, device=self.device)
        rows = torch.arange(len(requests), device=self.device)  # sample index of each cache row
        longest = max(len(p) for p in prompts)  # the longest live row, on the host
        for step in range(steps):
            tokens, log_probs = self._choose(logits, rows, step, uniforms, sampling, processor)
            # rows that finished stay until the next compaction; what they write after their
            # end is past their length and never read
            out_tokens[rows, step] = tokens
            out_log_probs[rows, step] = log_probs
            alive = produced[rows] > steps
            ended = torch.isin(tokens, stops) & alive
            produced[rows] = torch.where(ended, step + 1, produced[rows])
            if step == steps - 1:
                break
            if (step + 1) % self.check_every == 0:  # the host looks: one synchronisation
                keep = produced[rows] > steps
                finished = len(rows) - int(keep.sum())
                if finished == len(rows):
                    break
                if finished >= max(1, int(len(rows) * COMPACT_FRACTION)):
                    if sessions is not None:  # the rows leaving keep their keys and values
                        gone = (~keep).nonzero()[:, 0].tolist()
                        self._keep(sessions, prompts, caches, rows, gone, produced, out_tokens)
                    caches = [(k[keep], v[keep]) for k, v in caches]
                    rows, lengths, tokens = rows[keep], lengths[keep], tokens[keep]
                    longest = int(lengths.max())
            logits = self._decode(caches, lengths, tokens, longest + 1)
            lengths, longest = lengths + 1, longest + 1
        if sessions is not None:
            everyone = list(range(len(rows)))
            self._keep(
                sessions, prompts, caches, rows, everyone, produced.clamp(max=steps), out_tokens
            )
        # the one read of the results
        counts = produced.clamp(max=steps).tolist()
        stopped = (produced <= steps).tolist()
        token_rows, log_prob_rows = out_tokens.tolist(), out_log_probs.tolist()
        return [
            Sample(
                request=request,
                prompt=list(prompts[request]),
                tokens=token_rows[j][: counts[j]],
                log_probs=log_prob_rows[j][: counts[j]],
                finish="stop" if stopped[j] else "length",
            )
            for j, request in enumerate(requests)
        ]

    @staticmethod
    def _uniforms(
        sampling: SamplingConfig,
        request_seeds: Sequence[int] | None,
        request: int,
        index: int,
        resume: Sequence[Resume] | None,
    ) -> torch.Tensor:
        """The uniforms sample ``index`` of ``request`` draws its tokens with, one per step. A
        continued sample skips the ones its first ``offset`` tokens used: ``torch.rand`` draws a
        generator's stream in order, so it then samples as it would have in one call."""
        where = resume[request] if resume is not None else Resume(index, 0)
        seed = sample_seed(
            sampling.seed, request_seeds[request] if request_seeds else request, where.sample
        )
        stream = torch.Generator().manual_seed(seed)
        return torch.rand(where.offset + sampling.max_new_tokens, generator=stream)[where.offset :]

    # -- the model, step by step ---------------------------------------------------------------

    def _fuse(self) -> None:
        """Per call (weights change between calls): each layer's q/k/v and gate/up weights
        concatenated into one matrix each — fewer, larger matrix products per step. Under tensor
        parallel these are this rank's column slices; the row-parallel o/down projections stay
        modules, whose hooks all-reduce."""
        self.fused = []
        # Under a bf16 autocast the fused matrices are cast once here, not at every product
        # (autocast caches casts only of leaf weights that require grad).
        where = self.device.type
        cast = torch.get_autocast_dtype(where) if torch.is_autocast_enabled(where) else None
        for layer in self.base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            biases = [_bias(p) for p in projections]
            runtime = self.lora_at_runtime and any(
                is_lora_layer(p) for p in (*projections, mlp.gate_proj, mlp.up_proj)
            )
            weights = [effective_weight(p) for p in projections]
            merged_out = [  # adapted row-parallel projections, merged (tp is 1 with adapters)
                None if self.lora_at_runtime or not is_lora_layer(p) else effective_weight(p)
                for p in (attn.o_proj, mlp.down_proj)
            ]
            self.fused.append(
                Fused(
                    qkv=None if runtime else torch.cat(weights).to(cast),
                    qkv_bias=torch.cat([_local(b) for b in biases if b is not None])
                    if biases[0] is not None
                    else None,
                    split=[w.shape[0] for w in weights],
                    gate_up=None
                    if runtime
                    else torch.cat(
                        [effective_weight(mlp.gate_proj), effective_weight(mlp.up_proj)]
                    ).to(cast),
                    norms=(rms(layer.input_layernorm), rms(layer.post_attention_layernorm)),
                    o=None if merged_out[0] is None else merged_out[0].to(cast),
                    down=None if merged_out[1] is None else merged_out[1].to(cast),
                )
            )

    def _attention_block(
        self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[B, heads, S, head_dim]`` of this rank's heads, rotary applied."""
        fused = self.fused[index]
        h = fused.norms[0](x)
        if fused.qkv is None:  # LoRA applied at run time: PEFT's layers as modules
            attn = self.base.layers[index].self_attn
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        else:
            q, k, v = F.linear(h, fused.qkv, fused.qkv_bias).split(fused.split, dim=-1)
        shape = (*h.shape[:-1], -1, self.head_dim)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        heads = q.shape[1]
        both = apply_rotary(torch.cat([q, k], dim=1), cos, sin)  # one rotation for q and k
        return both[:, :heads], both[:, heads:], v

    def _finish_layer(self, index: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        layer, fused = self.base.layers[index], self.fused[index]
        out = attended.transpose(1, 2).reshape(*x.shape[:-1], -1)
        x = x + (layer.self_attn.o_proj(out) if fused.o is None else F.linear(out, fused.o))
        h = fused.norms[1](x)
        if fused.gate_up is None:
            gate, up = layer.mlp.gate_proj(h), layer.mlp.up_proj(h)
        else:
            gate, up = F.linear(h, fused.gate_up).chunk(2, dim=-1)
        act = F.silu(gate) * up
        return x + (layer.mlp.down_proj(act) if fused.down is None else F.linear(act, fused.down))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model.lm_head(self.base.norm(x))
        return logits.float()

    def _prefill(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new: int,
        past: Sequence[tuple[Session, int] | None] | None = None,
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
        """All prompts packed in one forward pass; returns per-layer caches (one row per sample,
        room for ``max_new`` more tokens), the lengths, and each sample's next-token logits.
        ``past[i]``: a kept session holding prompt i's first ``r`` tokens; only the rest of the
        prompt runs, attending to the session's keys and values."""
        device = self.device
        kept_by_prompt = past if past is not None else [None] * len(prompts)
        reused = [0 if kept is None else kept[1] for kept in kept_by_prompt]
        tails = [p[r:] for p, r in zip(prompts, reused, strict=True)]
        ids = torch.tensor([t for p in tails for t in p], device=device)[None]
        owners = [i + 1 for i, p in enumerate(tails) for _ in p]  # each token's prompt
        segments = torch.tensor(owners, device=device)[None]
        x = self.base.embed_tokens(ids)
        sizes = [len(p) for p in tails]
        firsts = [sum(sizes[:i]) for i in range(len(sizes))]
        spans = [(a, a + size) for a, size in zip(firsts, sizes, strict=True)]
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        starts = torch.tensor(firsts, device=device)
        width = max(len(p) for p in prompts) + max_new
        self._rotary(x, width)
        offsets = torch.tensor([reused[o - 1] for o in owners], device=device, dtype=torch.long)
        positions = segment_positions(segments)[0] + offsets
        cos, sin = self.cos[positions][None], self.sin[positions][None]
        caches = []
        for index in range(len(self.base.layers)):
            q, k, v = self._attention_block(index, x, cos, sin)
            # causal attention within each prompt: the projections ran packed, attention runs
            # per prompt (a dense block-diagonal mask would cost (sum of lengths)^2)
            attended = torch.cat(
                [
                    self._prompt_attention(q, k, v, a, b, None if past is None else past[i], index)
                    for i, (a, b) in enumerate(spans)
                ],
                dim=2,
            )
            caches.append(
                (
                    self._scatter(k, spans, n, width, past, index, keys=True),
                    self._scatter(v, spans, n, width, past, index, keys=False),
                )
            )
            x = self._finish_layer(index, x, attended)
        last = self._logits(x[0, starts + torch.tensor(sizes, device=device) - 1])
        self.last_prefill = (sum(sizes), sum(reused))
        self.last_reused = [r for r in reused for _ in range(n)]
        return caches, lengths.repeat_interleave(n), last.repeat_interleave(n, dim=0)

    def _rotary(self, x: torch.Tensor, width: int) -> None:
        """Rotary tables (``self.cos``, ``self.sin``) for every position below ``width`` at
        least, looked up per step; computed again only when too short (they depend on the
        position alone)."""
        held = getattr(self, "cos", None)
        if held is not None and held.shape[0] >= width and held.dtype == x.dtype:
            return
        where = torch.arange(width, device=self.device)[None]
        self.cos, self.sin = (t[0] for t in self.base.rotary_emb(x, where))

    @staticmethod
    def _prompt_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: int,
        b: int,
        past: tuple[Session, int] | None,
        layer: int,
    ) -> torch.Tensor:
        """Causal attention of one prompt's packed tokens ``[a, b)``, after a kept prefix."""
        if past is None:
            return F.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, enable_gqa=True
            )
        session, r = past
        keys = torch.cat([session.keys[layer][None, :, :r], k[:, :, a:b]], dim=2)
        values = torch.cat([session.values[layer][None, :, :r], v[:, :, a:b]], dim=2)
        # query j sits at position r + j: it sees every kept key and the new ones up to itself
        seen = (
            torch.arange(r + b - a, device=q.device)[None, :]
            <= (r + torch.arange(b - a, device=q.device))[:, None]
        )
        return F.scaled_dot_product_attention(
            q[:, :, a:b], keys, values, attn_mask=seen, enable_gqa=True
        )

    @staticmethod
    def _scatter(
        packed: torch.Tensor,
        spans: list[tuple[int, int]],
        n: int,
        width: int,
        past: Sequence[tuple[Session, int] | None] | None = None,
        layer: int = 0,
        keys: bool = True,
    ) -> torch.Tensor:
        heads, dim = packed.shape[1], packed.shape[3]
        cache = packed.new_zeros((len(spans) * n, heads, width, dim))
        for i, (start, end) in enumerate(spans):
            kept = None if past is None else past[i]
            r = 0 if kept is None else kept[1]
            if kept is not None:
                held = kept[0].keys[layer] if keys else kept[0].values[layer]
                cache[i * n : (i + 1) * n, :, :r] = held[:, :r]
            cache[i * n : (i + 1) * n, :, r : r + end - start] = packed[0, :, start:end]
        return cache

    # -- sessions ------------------------------------------------------------------------------

    def _take_sessions(
        self, prompts: Sequence[Sequence[int]], sessions: SessionRequest | None
    ) -> list[tuple[Session, int] | None] | None:
        """Each prompt's kept session and how much of the prompt it holds (None: none)."""
        if sessions is None:
            return None
        found: list[tuple[Session, int] | None] = []
        for key, prompt in zip(sessions.keys, prompts, strict=True):
            if key is None:
                found.append(None)
                continue
            session, r = sessions.cache.take(key, prompt, sessions.version)
            found.append(None if session is None else (session, r))
        return found

    def _keep(
        self,
        sessions: SessionRequest,
        prompts: Sequence[Sequence[int]],
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        rows: torch.Tensor,
        picked: list[int],
        produced: torch.Tensor,
        out_tokens: torch.Tensor,
    ) -> None:
        """Keep the cache rows ``picked`` as their sessions: the keys and values of the prompt
        and of the sampled tokens fed back (all but the last)."""
        for row in picked:
            request = int(rows[row])  # n = 1: the sample is its request
            key = sessions.keys[request]
            if key is None:
                continue
            count = int(produced[request])
            held = len(prompts[request]) + count - 1
            ids = [*prompts[request], *out_tokens[request, : count - 1].tolist()]
            sessions.cache.put(
                key,
                Session(
                    ids,
                    [k[row, :, :held].clone() for k, _ in caches],
                    [v[row, :, :held].clone() for _, v in caches],
                    sessions.version,
                ),
            )

    def _decode(
        self,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        lengths: torch.Tensor,
        tokens: torch.Tensor,
        span: int,
    ) -> torch.Tensor:
        """One token per live row at position ``lengths``; returns the next logits ``[B, V]``.
        ``span`` (the longest row's length + 1) comes from the host: reading it off ``lengths``
        would synchronise at every step."""
        batch = torch.arange(len(tokens), device=self.device)
        hidden = (torch.arange(span, device=self.device)[None, :] > lengths[:, None])[
            :, None, None, :
        ]
        x = self.base.embed_tokens(tokens[:, None])
        cos, sin = self.cos[lengths][:, None], self.sin[lengths][:, None]
        for index, (k_cache, v_cache) in enumerate(caches):
            q, k, v = self._attention_block(index, x, cos, sin)
            k_cache[batch, :, lengths] = k[:, :, 0]
            v_cache[batch, :, lengths] = v[:, :, 0]
            attended = decode_attention(q, k_cache[:, :, :span], v_cache[:, :, :span], hidden)
            x = self._finish_layer(index, x, attended)
        return self._logits(x[:, 0])

    # -- sampling ------------------------------------------------------------------------------

    @staticmethod
    def _choose(
        logits: torch.Tensor,
        rows: torch.Tensor,
        step: int | torch.Tensor,
        uniforms: torch.Tensor,
        sampling: SamplingConfig,
        processor: LogitsProcessor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token per row and its log-prob under the unfiltered, temperature-scaled softmax.
        ``step``: the index of the token being chosen, for every row or (iteration-level
        batching) per row; a processor is only given a shared one."""
        temperature = sampling.temperature or 1.0
        log_probs = torch.log_softmax(logits / temperature, dim=-1)
        shaped = logits
        if processor is not None:
            if not isinstance(step, int):
                raise GenerationError("a logits processor needs one step shared by every row")
            shaped = processor(rows, step, logits)
        if sampling.greedy:
            tokens = shaped.argmax(-1)
        else:
            probs = filtered_probs(shaped / temperature, sampling.top_k, sampling.top_p)
            cdf = probs.cumsum(-1)
            target = uniforms[rows, step][:, None] * cdf[:, -1:]
            tokens = torch.searchsorted(cdf, target).squeeze(-1).clamp(max=probs.shape[-1] - 1)
        return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


@dataclass
class Fused:
    qkv: torch.Tensor | None  # None: LoRA at run time, the projections run as modules
    qkv_bias: torch.Tensor | None
    split: list[int]
    gate_up: torch.Tensor | None
    norms: tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]
    o: torch.Tensor | None = None  # a LoRA-merged o_proj / down_proj weight (else: the module)
    down: torch.Tensor | None = None


def _bias(proj: Any) -> torch.Tensor | None:
    return proj.base_layer.bias if is_lora_layer(proj) else proj.bias


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def rms(norm: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A model's RMSNorm module as one fused op (same formula: x / rms(x) * weight)."""
    weight = _local(norm.weight)
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    return lambda x: F.rms_norm(x, (x.shape[-1],), weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding in the Llama (half-split) layout, for ``[B, H, S, D]``."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor
) -> torch.Tensor:
    """Attention of one new token per row: q ``[B, H, 1, D]`` over k, v ``[B, KV, S, D]`` with
    ``hidden`` ``[B, 1, 1, S]`` marking keys beyond each row's length. Grouped-query heads share
    their key/value head without copies; for a single query this beats SDPA's CPU kernel."""
    rows, heads, _, dim = q.shape
    groups = heads // k.shape[1]
    grouped = q.view(rows, k.shape[1], groups, dim)
    scores = grouped @ k.transpose(-1, -2) * dim**-0.5
    weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return (weights @ v).view(rows, heads, 1, dim)


def filtered_probs(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Softmax of ``scaled`` logits with top-k, then top-p (nucleus) filtering; unnormalised
    (sampling scales by the total)."""
    probs = torch.softmax(scaled, dim=-1)
    if top_k and top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
    if top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        total = ordered.sum(-1, keepdim=True)
        before = ordered.cumsum(-1) - ordered  # mass strictly above each token
        ordered = torch.where(before < top_p * total, ordered, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
    return probs
