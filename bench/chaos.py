"""The chaos benchmark: a GRPO run whose ranks are killed with SIGKILL at random, and survives.

``python -m bench.chaos`` runs the quickstart's tiny model through SFT and GRPO (``--steps``,
default 60) with a separate rollout group, a separate reward group and a checkpoint every
``--save-every`` steps, twice: undisturbed, then with a chaos thread that sends ``kill -9`` to a
random rank of a random group at random moments (``--kills``, every group hit at least once,
rank 0s included; seeded by ``--seed`` so a run can be repeated). Every group has a restart
policy: the stateless ones by default, the actor's group set here (its death rolls the run back
to the last checkpoint). It reports whether the run completed, each kill and what recovered it,
recovery seconds per group kind, the steps replayed, the wall-time overhead against the
undisturbed run and whether the final weights are bitwise equal (deterministic: they must be).
The last line is one JSON object with ``kills``, ``survived``, ``completed``, ``weights_equal``,
``recovery_s_max`` (and ``recovery_s_max_<kind>``), ``steps_replayed``, ``overhead_s``.

The chaos is external, as a real fault is: ranks are found in ``/proc`` below the run's process
by their titles (``ranks``), and a kill waits until the run logged a given step and the target
group is up again (a kill is never aimed at a process that is already gone).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from deploy.processes import descendants, rank_title

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "quickstart.yaml"

#: the run the benchmark and the supervision tests use: the quickstart's tiny model, its actor
#: alone on 2 ranks, a rollout group and a reward group of 1 rank each
GROUPS = [
    "roles.rollout={model: base}",
    "placement.main={roles: [actor], nproc: 2, restart: {max: 20, backoff_s: [0.0]}}",
    "placement.gen={roles: [rollout], nproc: 1, restart: {max: 20, backoff_s: [0.0]}}",
    "placement.score={roles: [reward], nproc: 1, restart: {max: 20, backoff_s: [0.0]}}",
    "trainer.val_data=null",
    "logging.tensorboard=false",
]


def settings(steps: int, save_every: int, sft_steps: int = 2) -> list[str]:
    return [
        *GROUPS,
        f"stages.0.steps={sft_steps}",
        "stages.0.optim.warmup_steps=1",
        f"stages.1.steps={steps}",
        f"trainer.save_every={save_every}",
    ]


def command(run_dir: Path, sets: list[str], example: Path = EXAMPLE) -> list[str]:
    argv = [sys.executable, "-m", "deploy.cli", "run", str(example), "--quick", "--json"]
    argv += [x for s in sets for x in ("--set", s)]
    return [*argv, "--run-dir", str(run_dir)]


def ranks(parent: int) -> dict[tuple[str, int], int]:
    """(group, rank) -> pid of every rank process a launcher in process ``parent`` started (its
    children, or its fork server's), found by their titles."""
    found = {}
    for pid in descendants(parent):
        title = rank_title(pid)
        if title is not None:
            found[title] = pid
    return found


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return found


def logged(run_dir: Path, step: int) -> bool:
    return any(r.get("step", 0) >= step and "stage_step" in r for r in records(run_dir))


@dataclass
class Kill:
    """Kill rank ``rank`` of ``group`` once the run logged step ``after``."""

    after: int
    group: str
    rank: int
    pid: int = 0
    at: float = 0.0


@dataclass
class Chaos:
    """Runs the kills of a plan against the run of process ``proc``, in a thread."""

    proc: subprocess.Popen[Any]
    run_dir: Path
    plan: list[Kill]
    expect: dict[str, int] = field(default_factory=dict)  # group -> ranks it has
    done: list[Kill] = field(default_factory=list)
    error: str = ""

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        try:
            for kill in self.plan:
                if not self._wait(lambda k=kill: logged(self.run_dir, k.after), 600):
                    return
                target: dict[str, int] = {}

                def up(k: Kill = kill, found: dict[str, int] = target) -> bool:
                    live = ranks(self.proc.pid)
                    pid = live.get((k.group, k.rank))
                    if pid is None:
                        return False
                    found["pid"] = pid
                    return all(
                        (g, r) in live for g, n in self.expect.items() for r in range(n)
                    )  # every group up: no kill lands on a restart still under way

                if not self._wait(up, 300):
                    return
                kill.pid, kill.at = target["pid"], time.monotonic()
                os.kill(kill.pid, signal.SIGKILL)
                self.done.append(kill)
        except Exception as exc:  # reported by the caller
            self.error = f"{type(exc).__name__}: {exc}"

    def _wait(self, predicate: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)  # polling /proc and a file: the observable state
        return True


def run(
    run_dir: Path,
    sets: list[str],
    plan: list[Kill],
    groups: dict[str, int],
    example: Path = EXAMPLE,
) -> dict[str, Any]:
    """One run of ``hybridflow run`` with ``plan``'s kills; rc, wall seconds, kills, output.
    ``groups``: group -> ranks, all up before each kill."""
    start = time.monotonic()
    argv = command(run_dir, sets, example)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    chaos = Chaos(proc, run_dir, plan, groups)
    thread = chaos.start()
    output, _ = proc.communicate(timeout=3600)
    thread.join(timeout=10)
    left = ranks(proc.pid)
    return {
        "rc": proc.returncode,
        "wall_s": time.monotonic() - start,
        "kills": chaos.done,
        "output": output,
        "chaos_error": chaos.error,
        "orphans": left,
    }


def weights(run_dir: Path) -> dict[str, Any]:
    return load_file(run_dir / "export" / "actor" / "model.safetensors")


def equal(a: Path, b: Path) -> bool:
    x, y = weights(a), weights(b)
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)


def events(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in records(run_dir) if "event" in r]


KIND = {"main": "actor", "gen": "rollout", "score": "reward"}
SIZES = {"main": 2, "gen": 1, "score": 1}


def chaos_plan(seed: int, kills: int, steps: int, sft_steps: int) -> list[Kill]:
    """``kills`` kills at random steps of the RL stage: every group hit, rank 0s included."""
    rng = random.Random(seed)
    targets = [("main", 0), ("main", 1), ("gen", 0), ("score", 0)]
    while len(targets) < kills:
        group = rng.choice(sorted(SIZES))
        targets.append((group, rng.randrange(SIZES[group])))
    rng.shuffle(targets)
    first, last = sft_steps + 2, sft_steps + steps - 2
    afters = sorted(rng.randint(first, last) for _ in targets)
    return [Kill(a, g, r) for a, (g, r) in zip(afters, targets, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps")
    parser.add_argument("--save-every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--kills", type=int, default=8, help="kill -9s (at least 4)")
    parser.add_argument("--seed", type=int, default=0, help="the chaos's seed")
    parser.add_argument("--dir", type=Path, help="where the two runs go (default: a temp dir)")
    args = parser.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="chaos-"))
    sets = settings(args.steps, args.save_every)
    calm = run(base / "calm", sets, [], SIZES)
    if calm["rc"] != 0:
        raise SystemExit(f"the undisturbed run failed:\n{calm['output'][-3000:]}")
    plan = chaos_plan(args.seed, max(args.kills, 4), args.steps, 2)
    hit = run(base / "chaos", sets, plan, SIZES)
    found = events(base / "chaos")
    recovered = [e for e in found if e["event"] in ("restart", "rollback")]
    per_kind: dict[str, list[float]] = {}
    for e in recovered:
        per_kind.setdefault(KIND.get(e["group"], e["group"]), []).append(float(e["recover_s"]))
    print("kill  after step  group  rank  pid")
    for kill in hit["kills"]:
        print(f"      {kill.after:>10}  {kill.group:<5}  {kill.rank:>4}  {kill.pid}")
    print("recovery: " + json.dumps([{k: e[k] for k in e if k != "cause"} for e in recovered]))
    completed = hit["rc"] == 0
    if not completed:
        print(hit["output"][-3000:])
    replayed = sum(int(e.get("steps_replayed", 0)) for e in recovered)
    result: dict[str, Any] = {
        "steps": args.steps,
        "save_every": args.save_every,
        "seed": args.seed,
        "kills": len(hit["kills"]),
        "survived": len(recovered) if completed else 0,
        "completed": completed,
        "weights_equal": completed and equal(base / "calm", base / "chaos"),
        "recovery_s_max": max((max(v) for v in per_kind.values()), default=0.0),
        **{f"recovery_s_max_{k}": round(max(v), 2) for k, v in per_kind.items()},
        **{f"recovery_s_mean_{k}": round(sum(v) / len(v), 2) for k, v in per_kind.items()},
        "steps_replayed": replayed,
        "wall_s_calm": round(calm["wall_s"], 1),
        "wall_s_chaos": round(hit["wall_s"], 1),
        "overhead_s": round(hit["wall_s"] - calm["wall_s"], 1),
        "orphans": len(hit["orphans"]),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
