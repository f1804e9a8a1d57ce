"""The RL step's levers on a real model, each measured alone: SmolLM2-135M with LoRA rank 16.

    python -m bench.levers            (about 3 minutes on 2 idle cores)

One GRPO-shaped micro-batch (``--rows`` rows of a ``--prompt``-token prompt and a
``--response``-token response, right-padded to a common width, as the actor sees it), under the
training engine's precision (bf16 autocast on a CPU with avx512_bf16, else fp32), one thread per
process as the ranks run. Timed, alternating the variants, medians of ``--repeats``:

* ``logprob``: the no-grad log-prob pass (old and reference log-probs) with logits at every
  position (``logits_at: all``) against logits only from the position before the first response
  token (``logits_at: response``, the engine's default): ``logprob_all_s``,
  ``logprob_response_s``, ``logprob_ratio``;
* ``step``: the update's forward and backward of the policy loss, the same two ways:
  ``step_all_s``, ``step_response_s``, ``step_ratio``;
* ``shared``: both of those with each group's prompt computed once (``--group`` rows share a
  prompt; ``share_prompts``, ``roles/modeling/shared_prompt.py``) against the rows as they are:
  ``logprob_shared_s``, ``step_shared_s``, ``shared_logprob_ratio``, ``shared_step_ratio``, and
  ``shared_token_share`` (the packed tokens over the rows' real tokens);
* ``fused``: one layer's q, k, v, gate and up products (forward and the backward to the input,
  as under LoRA) as five products against two fused ones (q|k|v, gate|up), over the shared
  batch's tokens: ``proj_separate_ms``, ``proj_fused_ms``, ``fused_proj_ratio``
  (``--only-fused`` runs this alone, in seconds);
* ``lora``: the log-prob pass with the adapters against the same pass with them disabled (the
  frozen base alone): ``lora_overhead`` (with / without - 1).

The last line is one JSON object with those keys and the workload.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from roles.modeling.logprob import logits_kept, token_log_probs
from roles.modeling.lora import LoraSettings, adapters_disabled, attach
from roles.modeling.models import import_gguf, load_causal_lm
from roles.modeling.shared_prompt import PromptPack, pack_shared_prompts
from roles.runtime.device import HOST_DEVICE, attention_kernel, choose_dtype, rank_device
from transport.device import DeviceKind


def batch(
    rows: int, prompt: int, response: int, vocab: int, group: int = 1
) -> dict[str, torch.Tensor]:
    """Rows of ``prompt`` + a response of ``response`` tokens less a ragged tail (0-24%); each
    ``group`` rows in a row share their prompt (GRPO's samples of one prompt)."""
    gen = torch.Generator().manual_seed(0)
    width = prompt + response
    ids = torch.randint(100, vocab, (rows, width), generator=gen)
    ids[:, :prompt] = ids[torch.arange(rows) // group * group, :prompt]
    lengths = width - (torch.rand(rows, generator=gen) * 0.25 * response).long()
    attention = (torch.arange(width)[None, :] < lengths[:, None]).long()
    response_mask = attention * (torch.arange(width)[None, :] >= prompt).long()
    return {
        "input_ids": ids * attention,
        "attention_mask": attention,
        "response_mask": response_mask,
    }


def alternating_medians(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Each variant's median time after one warm-up call, the variants run in turn so the
    machine's drift hits every one alike."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name] += timed(fn, 1)
    return {name: statistics.median(t) for name, t in times.items()}


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def lora_model(model_dir: Path) -> Any:
    """SmolLM2 with rank-16 adapters whose B is not zero (so they change the numbers)."""
    torch.manual_seed(0)
    model = load_causal_lm(str(model_dir))
    attach(model, LoraSettings(rank=16, alpha=32))
    torch.nn.init.normal_(next(p for n, p in model.named_parameters() if "lora_B" in n), std=0.01)
    return model


def shared(
    ids: torch.Tensor, attention: torch.Tensor, response: torch.Tensor, keep: int
) -> PromptPack:
    """The rows with each group's prompt once, however little that saves."""
    pack = pack_shared_prompts(ids, attention, response, keep or ids.shape[1], min_saved=0)
    if pack is None:
        raise ValueError("no row has a prompt to share")
    return pack


def measure(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = lora_model(model_dir)
    bf16 = choose_dtype("auto", rank_device(DeviceKind.CPU, 0, "bench")).dtype == "bf16"
    data = batch(args.rows, args.prompt, args.response, int(model.config.vocab_size), args.group)
    ids, attention, response = data["input_ids"], data["attention_mask"], data["response_mask"]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    keep = logits_kept(response)

    kernel = attention_kernel("auto", HOST_DEVICE, "bf16" if bf16 else "fp32", ids.shape[1])
    model.config._attn_implementation = kernel  # the engine's choice for these rows
    pack = shared(ids, attention, response, keep)

    def forward(kept: int) -> torch.Tensor:
        extra = {"logits_to_keep": kept} if kept else {}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(
                input_ids=ids, attention_mask=attention, position_ids=positions, **extra
            ).logits
        return token_log_probs(logits, ids) * response

    def shared_forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(
                input_ids=pack.input_ids,
                attention_mask=pack.attention_mask(kernel, torch.float32),
                position_ids=pack.positions,
                logits_to_keep=pack.columns,
            ).logits
        return token_log_probs(pack.gather(logits), ids) * response

    def logprob(kept: int, shared: bool = False) -> Callable[[], Any]:
        def run() -> None:
            with torch.no_grad():
                shared_forward() if shared else forward(kept)

        return run

    def step(kept: int, shared: bool = False) -> Callable[[], Any]:
        def run() -> None:
            logp = shared_forward() if shared else forward(kept)
            loss = -(logp * 0.5).sum() / response.sum()
            loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    def base_only() -> None:
        with adapters_disabled(model):
            logprob(keep)()

    # the two ways give the same numbers where responses are read
    with torch.no_grad():
        same = (forward(0) - forward(keep)).abs().max().item()
        shared_gap = (shared_forward() - forward(keep)).abs().max().item()
    variants = {
        "logprob_all": logprob(0),
        "logprob_response": logprob(keep),
        "logprob_shared": logprob(keep, shared=True),
        "step_all": step(0),
        "step_response": step(keep),
        "step_shared": step(keep, shared=True),
        "base_only": base_only,
    }
    med = alternating_medians(variants, args.repeats)
    return {
        **fused(args, bf16, pack.tokens),
        **ratios(med),
        "shared_token_share": round(pack.tokens / int(attention.sum()), 3),
        "max_logprob_gap": same,
        "max_shared_gap": shared_gap,
        "group": args.group,
        "attention": kernel,
        "rows": args.rows,
        "prompt_tokens": args.prompt,
        "response_tokens": args.response,
        "logits_kept": keep,
        "dtype": "bf16" if bf16 else "fp32",
        "repeats": args.repeats,
    }


def ratios(med: dict[str, float]) -> dict[str, float]:
    """The timed variants' medians and each lever's ratio."""
    return {
        "logprob_all_s": round(med["logprob_all"], 3),
        "logprob_response_s": round(med["logprob_response"], 3),
        "logprob_ratio": round(med["logprob_response"] / med["logprob_all"], 3),
        "step_all_s": round(med["step_all"], 3),
        "step_response_s": round(med["step_response"], 3),
        "step_ratio": round(med["step_response"] / med["step_all"], 3),
        "lora_overhead": round(med["logprob_response"] / med["base_only"] - 1, 3),
        "logprob_shared_s": round(med["logprob_shared"], 3),
        "step_shared_s": round(med["step_shared"], 3),
        "shared_logprob_ratio": round(med["logprob_shared"] / med["logprob_response"], 3),
        "shared_step_ratio": round(med["step_shared"] / med["step_response"], 3),
    }


def fused(args: argparse.Namespace, bf16: bool, tokens: int) -> dict[str, Any]:
    """One SmolLM2 layer's projections over ``tokens`` tokens, forward and the backward to the
    input (the frozen base under LoRA): q, k, v and gate, up as five products against q|k|v and
    gate|up as two. What fusing them could save, before any model change."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 576, generator=gen, requires_grad=True)
    shapes = {"q": 576, "k": 192, "v": 192, "gate": 1536, "up": 1536}
    weights = {n: torch.randn(o, 576, generator=gen) * 0.02 for n, o in shapes.items()}
    qkv = torch.cat([weights["q"], weights["k"], weights["v"]])
    gate_up = torch.cat([weights["gate"], weights["up"]])

    def run(mats: list[torch.Tensor]) -> Callable[[], Any]:
        def go() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                outs = [torch.nn.functional.linear(x, w) for w in mats]
            torch.stack([o.float().sum() for o in outs]).sum().backward()
            x.grad = None

        return go

    variants = {"separate": run(list(weights.values())), "fused": run([qkv, gate_up])}
    med = alternating_medians(variants, args.repeats * 10)
    return {
        "proj_separate_ms": round(med["separate"] * 1e3, 2),
        "proj_fused_ms": round(med["fused"] * 1e3, 2),
        "fused_proj_ratio": round(med["fused"] / med["separate"], 3),
        "proj_tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group", type=int, default=8, help="rows sharing one prompt")
    parser.add_argument(
        "--model", type=Path, default=None, help="a model folder (default: SmolLM2)"
    )
    parser.add_argument(
        "--only-fused", action="store_true", help="only the fused-projection lever (seconds)"
    )
    args = parser.parse_args(argv)
    if args.only_fused:
        torch.set_num_threads(1)
        bf16 = choose_dtype("auto", rank_device(DeviceKind.CPU, 0, "bench")).dtype == "bf16"
        result = fused(args, bf16, args.rows * (args.prompt + args.response))
        print(json.dumps({**result, "dtype": "bf16" if bf16 else "fp32"}))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or import_gguf(Path(tmp) / "smollm2")
        print(json.dumps(measure(args, model)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
