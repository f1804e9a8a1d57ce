"""The ``native`` generation engine: a batched KV-cache sampler over a Hugging Face Llama-family
model's own modules (embeddings, attention projections, MLP, norms, rotary tables).

Where the time goes in generation on a CPU, and what this engine does about it:

* **prefill without padding** — every distinct prompt is packed into one sequence with a
  block-causal mask (one forward pass for the whole batch, no pad tokens), and a prompt sampled
  ``n`` times is prefilled once;
* **finished samples leave the batch** — the caches are compacted whenever a quarter of the rows
  have finished, so the remaining steps only compute live rows;
* **no per-step framework overhead** — one preallocated cache per layer, attention over the
  longest live row only, no generation-config machinery.

Sampling is per sample: each draws its uniforms from its own generator (seeded from the request
seed, the request index and the sample index), so a sample's tokens do not depend on the batch it
ran in. The reported log-probs follow ``roles/logprob.py``. With tensor parallel (the model's
projections split by ``roles/training/fsdp.py``'s plan), each rank runs the same loop on its heads;
the row-parallel projections all-reduce, so every rank samples the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from roles.generation.engine import (
    GenerationEngine,
    LogitsProcessor,
    Sample,
    SamplingConfig,
    check_prompts,
    sample_seed,
)
from roles.text import block_causal_mask, segment_positions

COMPACT_FRACTION = 0.25  # compact the caches once this share of the rows has finished


class NativeEngine(GenerationEngine):
    def __init__(self, model: Any, eos_token_id: int) -> None:
        self.model = model
        self.base = getattr(model, str(model.base_model_prefix))
        config = model.config
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.context = int(config.max_position_embeddings)
        self.eos = eos_token_id

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        processor: LogitsProcessor | None = None,
    ) -> list[Sample]:
        check_prompts(prompts, sampling, self.context)
        samples = [
            Sample(request=i, prompt=list(p))
            for i, p in enumerate(prompts)
            for _ in range(sampling.n)
        ]
        uniforms = torch.stack(
            [
                torch.rand(
                    sampling.max_new_tokens,
                    generator=torch.Generator().manual_seed(
                        sample_seed(sampling.seed, s.request, j % sampling.n)
                    ),
                )
                for j, s in enumerate(samples)
            ]
        )
        stops = torch.tensor(sampling.stop_token_ids or [self.eos])
        caches, lengths, logits = self._prefill(prompts, sampling.n, sampling.max_new_tokens)
        rows = torch.arange(len(samples))  # sample index of each cache row
        live = torch.ones(len(samples), dtype=torch.bool)
        for step in range(sampling.max_new_tokens):
            tokens, log_probs = self._choose(logits, rows, step, uniforms, sampling, processor)
            for row, token, logp in zip(
                rows.tolist(), tokens.tolist(), log_probs.tolist(), strict=True
            ):
                if live[row]:
                    samples[row].tokens.append(token)
                    samples[row].log_probs.append(logp)
            ended = torch.isin(tokens, stops) & live[rows]
            for row in rows[ended].tolist():
                samples[row].finish = "stop"
            live[rows[ended]] = False
            if not bool(live.any()) or step == sampling.max_new_tokens - 1:
                break
            keep = live[rows]
            if int((~keep).sum()) >= max(1, int(len(rows) * COMPACT_FRACTION)):
                caches = [(k[keep], v[keep]) for k, v in caches]
                rows, lengths, tokens = rows[keep], lengths[keep], tokens[keep]
            logits = self._decode(caches, lengths, tokens)
            lengths = lengths + 1
        for s in samples:
            s.finish = s.finish or "length"
        return samples

    # -- the model, step by step ---------------------------------------------------------------

    def _attention_block(
        self, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[B, heads, S, head_dim]`` of this rank's heads, rotary applied."""
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        shape = (*h.shape[:-1], -1, self.head_dim)
        q = attn.q_proj(h).view(shape).transpose(1, 2)
        k = attn.k_proj(h).view(shape).transpose(1, 2)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def _finish_layer(self, layer: Any, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        out = attended.transpose(1, 2).reshape(*x.shape[:-1], -1)
        x = x + layer.self_attn.o_proj(out)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model.lm_head(self.base.norm(x))
        return logits.float()

    def _prefill(
        self, prompts: Sequence[Sequence[int]], n: int, max_new: int
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
        """All prompts packed in one forward pass; returns per-layer caches (one row per sample,
        room for ``max_new`` more tokens), the lengths, and each sample's next-token logits."""
        ids = torch.tensor([t for p in prompts for t in p])[None]
        segments = torch.tensor([i + 1 for i, p in enumerate(prompts) for _ in p])[None]
        mask = block_causal_mask(segments)
        x = self.base.embed_tokens(ids)
        cos, sin = self.base.rotary_emb(x, segment_positions(segments))
        lengths = torch.tensor([len(p) for p in prompts])
        starts = torch.cumsum(lengths, 0) - lengths
        width = int(lengths.max()) + max_new
        caches = []
        for layer in self.base.layers:
            q, k, v = self._attention_block(layer, x, cos, sin)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            caches.append(
                (
                    self._scatter(k, starts, lengths, n, width),
                    self._scatter(v, starts, lengths, n, width),
                )
            )
            x = self._finish_layer(layer, x, attended)
        last = self._logits(x[0, starts + lengths - 1])
        return caches, lengths.repeat_interleave(n), last.repeat_interleave(n, dim=0)

    @staticmethod
    def _scatter(
        packed: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, n: int, width: int
    ) -> torch.Tensor:
        heads, dim = packed.shape[1], packed.shape[3]
        cache = packed.new_zeros((len(lengths) * n, heads, width, dim))
        for i, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            cache[i * n : (i + 1) * n, :, :length] = packed[0, :, start : start + length]
        return cache

    def _decode(
        self,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        lengths: torch.Tensor,
        tokens: torch.Tensor,
    ) -> torch.Tensor:
        """One token per live row at position ``lengths``; returns the next logits ``[B, V]``."""
        batch = torch.arange(len(tokens))
        span = int(lengths.max()) + 1
        visible = (torch.arange(span)[None, :] <= lengths[:, None])[:, None, None, :]
        x = self.base.embed_tokens(tokens[:, None])
        cos, sin = self.base.rotary_emb(x, lengths[:, None])
        for layer, (k_cache, v_cache) in zip(self.base.layers, caches, strict=True):
            q, k, v = self._attention_block(layer, x, cos, sin)
            k_cache[batch, :, lengths] = k[:, :, 0]
            v_cache[batch, :, lengths] = v[:, :, 0]
            attended = F.scaled_dot_product_attention(
                q, k_cache[:, :, :span], v_cache[:, :, :span], attn_mask=visible, enable_gqa=True
            )
            x = self._finish_layer(layer, x, attended)
        return self._logits(x[:, 0])

    # -- sampling ------------------------------------------------------------------------------

    @staticmethod
    def _choose(
        logits: torch.Tensor,
        rows: torch.Tensor,
        step: int,
        uniforms: torch.Tensor,
        sampling: SamplingConfig,
        processor: LogitsProcessor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token per row and its log-prob under the unfiltered, temperature-scaled softmax."""
        temperature = sampling.temperature or 1.0
        log_probs = torch.log_softmax(logits / temperature, dim=-1)
        shaped = processor(rows, step, logits) if processor is not None else logits
        if sampling.greedy:
            tokens = shaped.argmax(-1)
        else:
            probs = filtered_probs(shaped / temperature, sampling.top_k, sampling.top_p)
            cdf = probs.cumsum(-1)
            target = uniforms[rows, step][:, None] * cdf[:, -1:]
            tokens = torch.searchsorted(cdf, target).squeeze(-1).clamp(max=probs.shape[-1] - 1)
        return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


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
