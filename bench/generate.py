"""Generation benchmark: hybridflow's ``native`` engine against transformers' ``generate`` and,
when the ``[vllm]`` extra is installed, vLLM (``roles/engines/generation/vllm.py``).

Run ``python -m bench.generate`` (a few minutes) or ``python -m bench.generate --quick`` (< 60 s).
Both engines get the same work, in one process on one intra-op thread (like a role rank):

* 64 prompts of mixed length (arithmetic problems behind a random-length preamble, 5 to 51
  tokens), greedy decoding, in the same dtype;
* response lengths forced uniform in [max/4, max] by the same logits processor in both engines
  (``</s>`` is banned until a sample's drawn length, then forced), so neither wins by stopping
  early — but an engine that stops computing finished rows is rewarded, as it should be;
* the ~1M ("tiny") and ~18M ("small") models of ``roles.modeling.models.init_model``, fp32 and bf16
  weights as separate rows.

Reported: new response tokens per second (median of the timed repeats after one warm-up; native
and HF take turns), and the ratio native / HF. vLLM runs the same work in a process of its own
right after (vLLM's parallel state is one per process), with the forced lengths applied by the
engine's logits processor like the others. Every engine must produce exactly the forced number of
tokens, or the run aborts. The last line is a JSON object: ``native_tok_s_1m``, ``hf_tok_s_1m``,
``vllm_tok_s_1m``, the same for ``20m``, and all of them with ``_bf16`` (no ``vllm_`` keys
without the extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from roles.engines.generation.hf import HFEngine
from roles.engines.generation.interface import GenerationEngine, SamplingConfig
from roles.engines.generation.native import NativeEngine
from roles.modeling.models import init_model, load_causal_lm, load_tokenizer
from roles.runtime.device import bf16_speedup

BATCH = 64
SIZES = {"1m": "tiny", "20m": "small"}
out, err = Console(), Console(stderr=True)


def make_prompts(tokenizer: Any, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = "the of a to in is for on that with as was at by an be this from".split()
    prompts = []
    for _ in range(BATCH):
        preamble = " ".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
        text = f"{preamble} {rng.randint(0, 99)}+{rng.randint(0, 99)}=".strip()
        prompts.append([tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)])
    return prompts


class ForcedLengths:
    """The logits processor both engines get: sample i ends after exactly ``lengths[i]`` tokens."""

    def __init__(self, eos: int, max_new: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.eos = eos
        self.lengths = torch.randint(max(1, max_new // 4), max_new + 1, (BATCH,), generator=gen)

    def __call__(self, rows: torch.Tensor, step: int, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        ending = self.lengths[rows] == step + 1
        logits[~ending, self.eos] = float("-inf")
        forced = torch.full_like(logits[ending], float("-inf"))
        forced[:, self.eos] = 0.0
        logits[ending] = forced
        return logits


def timed(
    name: str,
    engine: GenerationEngine,
    prompts: list[list[int]],
    processor: ForcedLengths,
    max_new: int,
) -> float:
    """New tokens per second of one generate call, checked against the forced lengths."""
    sampling = SamplingConfig(temperature=0, max_new_tokens=max_new)
    start = time.perf_counter()
    samples = engine.generate(prompts, sampling, processor)
    elapsed = time.perf_counter() - start
    produced = sum(len(s.tokens) for s in samples)
    if produced != int(processor.lengths.sum()):
        raise RuntimeError(f"{name} produced {produced} tokens, not the forced lengths")
    return produced / elapsed


def measure_vllm(model_dir: Path, dtype: torch.dtype, max_new: int, repeats: int) -> float:
    """vLLM's median tokens/s on the same work, in a fresh process (one warm-up call first)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        rate: float = pool.apply(_vllm_rate, (str(model_dir), str(dtype), max_new, repeats))
    return rate


def _vllm_rate(model_dir: str, dtype_name: str, max_new: int, repeats: int) -> float:
    from roles.engines.generation.vllm import VLLMEngine

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(model_dir)
    prompts = make_prompts(tokenizer)
    processor = ForcedLengths(tokenizer.eos_token_id, max_new)
    context = int(load_causal_lm(model_dir).config.max_position_embeddings)
    engine = VLLMEngine(
        model_dir,
        dtype=getattr(torch, dtype_name.removeprefix("torch.")),
        eos_token_id=tokenizer.eos_token_id,
        context=context,
    )
    rates = [timed("vllm", engine, prompts, processor, max_new) for _ in range(repeats + 1)]
    engine.close()
    return statistics.median(rates[1:])


def measure(model_dir: Path, dtype: torch.dtype, max_new: int, repeats: int) -> dict[str, float]:
    """Median new tokens/s per engine; the engines take turns run by run, so the machine's drift
    (this VM's speed wanders by +-20% over minutes) hits both alike."""
    model = load_causal_lm(model_dir, dtype=dtype).eval()
    tokenizer = load_tokenizer(model_dir)
    prompts = make_prompts(tokenizer)
    processor = ForcedLengths(tokenizer.eos_token_id, max_new)
    engines: dict[str, GenerationEngine] = {
        "native": NativeEngine(model, tokenizer.eos_token_id),
        "hf": HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id),
    }
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for turn in range(repeats + 1):  # the first turn warms up
        for name, engine in engines.items():
            rate = timed(name, engine, prompts, processor, max_new)
            if turn:
                rates[name].append(rate)
    found = {name: statistics.median(values) for name, values in rates.items()}
    if importlib.util.find_spec("vllm") is not None:
        found["vllm"] = measure_vllm(model_dir, dtype, max_new, repeats)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats (< 60 s)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    max_new = {"1m": 64 if args.quick else 128, "20m": 24 if args.quick else 64}
    repeats = 1 if args.quick else 5
    report: dict[str, Any] = {"batch": BATCH, "max_new_tokens": max_new, "quick": args.quick}
    table = Table(title=f"generation, batch {BATCH}, greedy, forced lengths in [max/4, max]")
    columns = ["model", "dtype", "max new", "native tok/s", "HF tok/s", "native / HF"]
    with_vllm = importlib.util.find_spec("vllm") is not None
    columns += ["vLLM tok/s", "vLLM / HF"] if with_vllm else []
    for column in columns:
        table.add_column(column, justify="left" if column in ("model", "dtype") else "right")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for key, size in SIZES.items():
            model_dir = init_model(Path(tmp) / size, size)  # type: ignore[arg-type]
            for dtype, suffix in ((torch.float32, ""), (torch.bfloat16, "_bf16")):
                rates = measure(model_dir, dtype, max_new[key], repeats)
                ratio = rates["native"] / rates["hf"]
                err.print(
                    f"  {key}{suffix}: native {rates['native']:.0f} tok/s, hf {rates['hf']:.0f}"
                )
                report[f"native_tok_s_{key}{suffix}"] = round(rates["native"], 1)
                report[f"hf_tok_s_{key}{suffix}"] = round(rates["hf"], 1)
                report[f"ratio_{key}{suffix}"] = round(ratio, 3)
                row = [key, suffix[1:] or "fp32", str(max_new[key])]
                row += [f"{rates['native']:.0f}", f"{rates['hf']:.0f}", f"{ratio:.2f}x"]
                if "vllm" in rates:
                    report[f"vllm_tok_s_{key}{suffix}"] = round(rates["vllm"], 1)
                    row += [f"{rates['vllm']:.0f}", f"{rates['vllm'] / rates['hf']:.2f}x"]
                    err.print(f"  {key}{suffix}: vllm {rates['vllm']:.0f} tok/s")
                table.add_row(*row)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    # what dtype: auto would pick here (both dtypes are measured above either way)
    report["bf16_speedup_probe"] = round(bf16_speedup(), 2)
    out.print(table)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
