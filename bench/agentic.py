"""Multi-turn rollouts with slow tools: continuous serving against lock-step turns and against
tools that answer at once.

    python -m bench.agentic            (the full run: about 2 minutes on 2 idle cores)
    python -m bench.agentic --quick    (the CI-sized form, well under a minute)

The same work three times, on the same processes: a rollout group (one rank, the native engine,
fp32, the demo's 1.1M model by default) generates for ``prompts x n`` trajectories (128) of
``--steps`` tool calls each (8), ``--turn-tokens`` new tokens a turn (16)
(``bench/agentic_env.py``: every turn is an action whose latency is log-normal, median 50 ms,
p99 1 s, slept in the env group; the draws depend only on the trajectory and the step, so every
run sees the same latencies):

* (a) ``continuous``: hybridflow's multi-turn rollout (``controller/agent.py``): whenever the
  generator is free it serves every turn waiting; tools run concurrently in the env group; each
  trajectory is a session whose KV the engine keeps between its turns;
* ``no_sessions``: (a) with ``sessions: false``: every turn prefills the trajectory again;
* (b) ``lockstep``: the same code with continuous serving off: each generation call waits until
  every live trajectory has asked for its next turn (the naive baseline: a turn of the whole
  batch waits for its slowest tool);
* (c) ``no_latency``: (a) with tools that answer at once: the generator's own limit;
* ``vllm``: (a) on a vLLM rollout group (token ids in and out, its automatic prefix cache in
  blocks of 32 tokens): ``vllm_traj_per_s`` and ``vllm_prefix_hit_rate``, the share of the turns'
  prompt positions its prefix cache served (not in ``--quick``);
* ``vllm_iteration``: the same with ``serving: iteration``: each turn becomes a request of vLLM's
  own scheduler when it is asked for and returns the step it finishes (``VLLMTurnLoop``):
  ``vllm_iteration_traj_per_s``, ``vllm_iteration_prefix_hit_rate`` (not in ``--quick``);
* ``iteration`` and ``iteration_no_latency``: (a) and (c) with ``serving: iteration``: each turn
  joins the native engine's running decode batch when it is asked for and returns when it is
  done (``roles/engines/generation/iteration.py``), instead of waiting for the call in flight.
* ``stale`` (``--max-staleness K``, K >= 1): (a) while new weights arrive as they do when the
  trainer runs beside generation: every ``--push-every-s`` seconds (a training step's time) the
  rollout group loads a new weight version. A session's KV holds the old weights' keys and
  values, so each push drops every live session (``roles/engines/generation/sessions.py``: a
  session is used only at its version) and the next turn of each trajectory prefills it again:
  ``stale_traj_per_s``, ``stale_pushes`` (per batch), ``stale_reprefill_share`` and
  ``stale_vs_continuous``, the cost of keeping samples exact under pushes.

**The tools' floor.** No serving finishes a batch before its slowest trajectory's tools have
run: ``latency_floor_s`` is that trajectory's summed tool latency (median over rounds), and
``frac_of_floor`` (``iteration_frac_of_floor``) the floor over the batch's wall time. The
slowest trajectory also needs all of its turns' decode steps one after another; with 8 tool
calls per trajectory the floor (about 3 s here) is close to what the whole batch takes without
tool latency, so ``frac_of_no_latency`` near 1 would need that trajectory to decode nearly alone.

Where the targets hold depends on how much generation there is per tool call: with much more
(``--model small --steps 4 --turn-tokens 24``: 20 s of generation against 4 s of waiting in lock
step) every mode is generation-bound and lock step loses little; docs/results.md has both.

Targets: (a) >= 2x (b), and (a) >= 0.7x (c). ``generator_idle_share`` is the share of (a)'s wall
time with no generation call in flight. Each mode runs ``repeats`` times, taking turns; medians.

**Prefix reuse.** Every turn is a new generation call whose prompt is the whole trajectory so far.
With sessions the native engine keeps each trajectory's KV and prefills only what is new (the
observation); without, it prefills the whole prefix again. ``reprefill_share`` (with sessions)
and ``no_sessions_reprefill_share`` are the shares of the positions the generator ran (prefill
as the engine reports it, plus one per sampled token) that it had run before;
``session_speedup`` is (a) against ``no_sessions``; ``session_bytes_per_token`` what a kept
session costs per token (keys and values of every layer, fp32).

The last line is a JSON object: ``traj_per_s``, ``no_sessions_traj_per_s``, ``lockstep_traj_per_s``,
``no_latency_traj_per_s``, ``tok_per_s`` (sampled tokens per second of (a)), ``lockstep_tok_per_s``,
``no_latency_tok_per_s``, ``speedup_vs_lockstep``, ``frac_of_no_latency``,
``generator_idle_share``, ``reprefill_share``, ``no_sessions_reprefill_share``,
``session_speedup``, ``prefix_reuse``, ``session_bytes_per_token``, ``latency_floor_s``,
``frac_of_floor``, the ``iteration_*`` keys (``iteration_vs_continuous``: (iteration) against
(a)), and the workload. ``--modes`` runs a subset (the keys of the others are then absent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from safetensors.torch import load_file

from bench.agentic_env import MEDIAN_S, P99_S, STEPS
from controller.agent import AgentConfig, AgentRollout, run_trajectories
from controller.clients import EnvClient, RolloutClient
from controller.placement import GroupSpec, RoleSpec
from deploy.session import local_session
from roles.modeling.models import init_model, load_config
from transport.batch import TensorBatch
from transport.sampling import SamplingConfig
from transport.settings import Timeouts

err = Console(stderr=True)
MODES = (
    "continuous",
    "no_sessions",
    "lockstep",
    "no_latency",
    "iteration",
    "iteration_no_latency",
)
#: vLLM's KV blocks: its prefix cache reuses whole blocks, and a turn here adds ~22 tokens
VLLM_BLOCKS = {"kv_block_tokens": 32}


def group(name: str, role: str, cls: str, config: dict[str, Any]) -> GroupSpec:
    return GroupSpec(name=name, roles={role: RoleSpec(cls=cls, config=config)}, nproc=1)


def prompts(count: int) -> TensorBatch:
    texts = [f"task {i}: {17 * i % 97}+{31 * i % 89}=" for i in range(count)]
    batch = TensorBatch.from_dict(non_tensors={"prompt": texts, "uid": list(range(count))})
    batch.non_tensors["seed"] = [1000 + i for i in range(count)]
    return batch


async def measure(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    env = {
        "tokenizer": str(model),
        "workers": args.prompts * args.n,
        "environment": "bench.agentic_env:SlowTool",
    }
    slow = {**env, "environment_args": {"steps": args.steps}}
    fast = {**env, "environment_args": {"steps": args.steps, "scale": 0.0}}
    groups = [
        group("gen", "rollout", "roles.rollout:Rollout", {"model": str(model), "dtype": "fp32"}),
        group("slow", "env", "roles.env:EnvRole", slow),
        group("fast", "fast_env", "roles.env:EnvRole", fast),
    ]
    on_vllm = [m for m in args.modes if m.startswith("vllm")]
    if on_vllm:  # the same work on vLLM: token ids in and out, its prefix cache
        vllm = {"model": str(model), "dtype": "fp32", "engine": "vllm", "kv_cache_mb": 512}
        groups.append(group("vgen", "vllm", "roles.rollout:Rollout", {**vllm, **VLLM_BLOCKS}))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.turn_tokens, n=args.n, seed=1)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
    async with local_session(groups, Timeouts(call_s=600, connect_s=120)) as c:
        generators = {"native": RolloutClient(c, "rollout")}
        if on_vllm:
            generators["vllm"] = RolloutClient(c, "vllm")
        envs = {"slow": EnvClient(c, "env"), "fast": EnvClient(c, "fast_env")}
        specs = {k: await e.spec() for k, e in envs.items()}
        weights = load_file(str(model / "model.safetensors")) if "stale" in args.modes else {}
        session = 0
        for repeat in range(args.repeats + 1):  # the first round warms up
            for mode in args.modes:
                which = "fast" if mode.endswith("no_latency") else "slow"
                serving = "continuous"
                if mode.startswith("iteration") or mode == "lockstep":
                    serving = mode.split("_")[0]
                elif mode == "vllm_iteration":
                    serving = "iteration"
                cfg = AgentConfig(
                    max_turns=args.steps,
                    max_total_tokens=4096,
                    serving=serving,
                    sessions=mode != "no_sessions",
                )
                generator = generators["vllm" if mode.startswith("vllm") else "native"]
                setup = AgentRollout(generator, envs[which], cfg, specs[which], None, session)
                session += args.prompts * args.n
                pushes: list[int] = []
                done = asyncio.Event()
                pusher = (
                    asyncio.create_task(_push(generator, weights, args.push_every_s, done, pushes))
                    if mode == "stale"
                    else None
                )
                batch = await run_trajectories(setup, prompts(args.prompts), sampling, 0)
                if pusher is not None:
                    done.set()
                    await pusher
                found = dict(batch.meta["agent"])
                found["pushes"] = float(len(pushes))
                mask = batch.tensors["response_mask"]
                found["tokens"] = float(mask.sum())
                found["positions"] = _positions(batch, found["agent/prefilled_positions"])
                floor = found.get("agent/tool_latency_max_total_s", 0.0)
                found["floor_share"] = floor / found["agent/seconds"]
                if repeat:
                    runs[mode].append(found)
                err.print(
                    f"{'warm-up' if not repeat else f'round {repeat}'} {mode}: "
                    f"{found['agent/traj_per_s']:.2f} traj/s, {found['agent/seconds']:.2f} s, "
                    f"idle {found['agent/generator_idle_share']:.0%}"
                )
    found = summarize(runs, args)
    config = load_config(str(model))
    heads = int(getattr(config, "num_key_value_heads", config.num_attention_heads))
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    found["session_bytes_per_token"] = 2 * int(config.num_hidden_layers) * heads * dim * 4
    return found


async def _push(
    generator: RolloutClient,
    weights: dict[str, Any],
    every_s: float,
    done: asyncio.Event,
    pushed: list[int],
) -> None:
    """A new weight version every ``every_s`` seconds until ``done``: the same values (the
    samples' cost is what is measured, not a policy change), each a new version."""
    version = await generator.weight_version()
    while True:
        try:
            await asyncio.wait_for(done.wait(), every_s)
            return
        except TimeoutError:
            version += 1
            pushed.append(await generator.load_weights(weights, version))


def _positions(batch: TensorBatch, prefilled: float) -> tuple[float, float]:
    """(positions the generator ran over all turns, of which re-prefills). It ran the
    ``prefilled`` prompt positions (what the engine reports: with sessions, only what no kept
    KV covered) and one decode position per sampled token. Of the prefilled ones, new are each
    trajectory's first context and, at every later turn, its observation and the last token
    sampled before it (never fed back); the rest were run before: re-prefills."""
    new, sampled_total = 0.0, 0.0
    mask = batch.tensors["response_mask"]
    attention = batch.tensors["attention_mask"]
    for row in range(len(batch)):
        sampled = mask[row][attention[row].bool()].tolist()
        start = sampled.index(1) if 1 in sampled else len(sampled)
        # a turn starts wherever a sampled run begins, and ends where it stops
        turns = [i for i in range(start, len(sampled)) if sampled[i] and not sampled[i - 1]]
        ends = [
            i
            for i in range(start, len(sampled))
            if sampled[i] and (i + 1 == len(sampled) or not sampled[i + 1])
        ]
        new += start
        for index in range(1, len(turns)):
            new += turns[index] - ends[index - 1]  # the observation, and the last sampled token
        sampled_total += sum(sampled)
    return prefilled + sampled_total, max(0.0, prefilled - new)


def summarize(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    def tok_s(mode: str) -> float:
        return statistics.median(r["tokens"] / r["agent/seconds"] for r in runs[mode])

    def reprefill(mode: str) -> float:
        ran = sum(r["positions"][0] for r in runs[mode])
        again = sum(r["positions"][1] for r in runs[mode])
        return round(again / max(ran, 1.0), 3)

    stale = _stale(runs, args, median, reprefill) if "stale" in args.modes else {}
    if not set(MODES) <= set(args.modes):  # a subset: each mode's throughput only
        found = {f"{m}_traj_per_s": round(median(m, "agent/traj_per_s"), 3) for m in args.modes}
        return found | stale
    a, plain, b, c, it, it_c = (median(m, "agent/traj_per_s") for m in MODES)
    vllm: dict[str, float] = {}
    for m in ("vllm", "vllm_iteration"):
        if m in args.modes:
            vllm |= {
                f"{m}_traj_per_s": round(median(m, "agent/traj_per_s"), 3),
                f"{m}_tok_per_s": round(tok_s(m), 1),
                f"{m}_prefix_hit_rate": round(median(m, "agent/prefix_reuse"), 3),
                f"{m}_vs_native": round(median(m, "agent/traj_per_s") / a, 3),
            }
    if {"vllm", "vllm_iteration"} <= set(args.modes):
        vllm["vllm_iteration_vs_continuous"] = round(
            median("vllm_iteration", "agent/traj_per_s") / median("vllm", "agent/traj_per_s"), 3
        )

    return {
        "traj_per_s": round(a, 3),
        "lockstep_traj_per_s": round(b, 3),
        "no_latency_traj_per_s": round(c, 3),
        "tok_per_s": round(tok_s("continuous"), 1),
        "lockstep_tok_per_s": round(tok_s("lockstep"), 1),
        "no_latency_tok_per_s": round(tok_s("no_latency"), 1),
        "speedup_vs_lockstep": round(a / b, 3),
        "frac_of_no_latency": round(a / c, 3),
        "generator_idle_share": round(median("continuous", "agent/generator_idle_share"), 3),
        "lockstep_generator_idle_share": round(median("lockstep", "agent/generator_idle_share"), 3),
        "reprefill_share": reprefill("continuous"),
        "no_sessions_reprefill_share": reprefill("no_sessions"),
        "no_sessions_traj_per_s": round(plain, 3),
        "session_speedup": round(a / plain, 3),
        "prefix_reuse": round(median("continuous", "agent/prefix_reuse"), 3),
        # the bound the tools set: the batch's slowest trajectory's summed tool latencies,
        # against the batch's wall time (1.0: the run took no longer than its tools)
        "latency_floor_s": round(median("continuous", "agent/tool_latency_max_total_s"), 3),
        "frac_of_floor": round(median("continuous", "floor_share"), 3),
        "iteration_frac_of_floor": round(median("iteration", "floor_share"), 3),
        "iteration_traj_per_s": round(it, 3),
        "iteration_no_latency_traj_per_s": round(it_c, 3),
        "iteration_tok_per_s": round(tok_s("iteration"), 1),
        "iteration_vs_continuous": round(it / a, 3),
        "iteration_speedup_vs_lockstep": round(it / b, 3),
        "iteration_frac_of_no_latency": round(it / max(c, it_c), 3),
        "iteration_reprefill_share": reprefill("iteration"),
        "iteration_generator_idle_share": round(
            median("iteration", "agent/generator_idle_share"), 3
        ),
        "tool_latency_p50_s": round(median("continuous", "agent/tool_latency_p50_s"), 3),
        "tool_latency_p99_s": round(median("continuous", "agent/tool_latency_p99_s"), 3),
        "trajectories": args.prompts * args.n,
        "tool_calls_per_trajectory": args.steps,
        "turn_tokens": args.turn_tokens,
        "model": args.model,
        "latency_median_s": MEDIAN_S,
        "latency_p99_s": P99_S,
        "repeats": args.repeats,
        **vllm,
        **stale,
    }


def _stale(
    runs: dict[str, list[dict[str, Any]]],
    args: argparse.Namespace,
    median: Callable[[str, str], float],
    reprefill: Callable[[str], float],
) -> dict[str, Any]:
    """Mode stale's keys: continuous serving under weight pushes."""
    found = {
        "stale_traj_per_s": round(median("stale", "agent/traj_per_s"), 3),
        "stale_pushes": median("stale", "pushes"),
        "stale_reprefill_share": reprefill("stale"),
        "push_every_s": args.push_every_s,
    }
    if "continuous" in runs:
        found["stale_vs_continuous"] = round(
            found["stale_traj_per_s"] / median("continuous", "agent/traj_per_s"), 3
        )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4, help="trajectories per prompt")
    parser.add_argument("--turn-tokens", type=int, default=16, help="new tokens per turn")
    parser.add_argument("--steps", type=int, default=STEPS, help="tool calls per trajectory")
    parser.add_argument("--model", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="CI-sized: 8 prompts, 1 repeat")
    parser.add_argument(
        "--modes",
        type=lambda x: x.split(","),
        default=[*MODES, "vllm", "vllm_iteration"],
        help="a comma list of modes (default: all; --quick: all but the vllm ones)",
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="K >= 1 adds mode 'stale': weight pushes during generation, as a run with "
        "max_staleness K meets them",
    )
    parser.add_argument(
        "--push-every-s", type=float, default=1.0, help="mode stale: seconds between pushes"
    )
    args = parser.parse_args(argv)
    if args.max_staleness > 0 and "stale" not in args.modes:
        args.modes = [*args.modes, "stale"]
    if args.quick:
        args.prompts, args.n, args.repeats, args.steps = 8, 2, 1, 4
        args.modes = [m for m in args.modes if not m.startswith("vllm")]
    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / args.model, args.model, seed=0)
        report = asyncio.run(measure(args, model))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
