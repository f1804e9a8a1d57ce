"""Faults below the user's loop: the same deterministic policy-gradient loop, written against
``hybridflow.mesh``, run undisturbed and with ranks killed (SIGKILL) between its calls; the loop
must complete and end with bitwise equal weights.

The mesh places the actor on 2 ranks (a restart policy: its death rolls the training roles back
to the in-memory snapshot of the last optimizer step and replays the ``forward_backward`` calls
since), a rollout group and a reward group of one rank each (restarted alone; the call in flight
is sent again). ``KILLS`` hits one rank of each group kind, one of them between the two
``forward_backward`` calls of a step, so the replay is exercised; the actor's rank 0 is also
killed before an ``optim_step`` (the recovered step counts one policy version) and while the
snapshot after one is taken (the step runs again on the replayed gradients).

    python -m bench.api_chaos --steps 3      # the JSON's last line: api_chaos_equal, kills
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

import hybridflow as hf

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
RESTART = "restart: {max: 10, backoff_s: [0.0]}"
GROUPS = [
    "roles.rollout={model: base}",
    f"placement.main={{roles: [actor], nproc: 2, {RESTART}}}",
    f"placement.gen={{roles: [rollout], nproc: 1, {RESTART}}}",
    f"placement.score={{roles: [reward], nproc: 1, {RESTART}}}",
    "logging.tensorboard=false",
]
#: a kill while the snapshot after a step's ``optim_step`` is taken, not before a call
SNAPSHOT = "optim_step's snapshot"
#: (step, the call it comes before, group, rank): one kill per group kind, and two more of the
#: actor's: before a step, and while the snapshot after a step is taken
KILLS = [
    (0, "score", "score", 0),
    (0, SNAPSHOT, "main", 0),
    (1, "second backward", "main", 0),
    (2, "sample", "gen", 0),
    (2, "optim_step", "main", 0),
]

Kill = Callable[[int, str], None]


async def grpo_loop(m: hf.Mesh, steps: int, before: Kill, out: Path) -> list[float]:
    """REINFORCE with its gradient accumulated over two ``forward_backward`` calls per step;
    the mean reward per step. ``before(step, call)`` runs before each call (the chaos). The
    baseline is a fixed 0.5, not GRPO's group mean: the untrained model scores 0 on every
    answer, so a group baseline would leave no gradient and a lost one would go unseen."""
    await m.configure_optim(hf.OptimConfig(lr=1e-3, warmup_steps=0))
    prompts = hf.rows("builtin:arithmetic?n=512&split=train")
    loss = hf.PolicyLossConfig(dual_clip=None, agg="token-mean")
    rewards = []
    for step in range(steps):
        before(step, "sample")
        sampling = hf.SamplingConfig(n=4, max_new_tokens=8, seed=step)
        batch = await m.sample(prompts[8 * step : 8 * step + 8], sampling)
        before(step, "score")
        score, _ = await m.score(batch)
        batch.tensors["advantages"] = (score - 0.5)[:, None] * batch.tensors["response_mask"]
        before(step, "log_probs")
        batch.tensors["old_log_probs"] = await m.log_probs(batch)
        first, second = batch.chunk(2)
        before(step, "first backward")
        await m.forward_backward(first, loss)
        before(step, "second backward")
        await m.forward_backward(second, loss)
        before(step, "optim_step")
        await m.optim_step()
        rewards.append(float(score.mean()))
    await m.export(out)
    return rewards


class Chaos:
    """Kills the rank ``KILLS`` names before the call it names, found in the mesh's
    ``processes.json``, and waits until the process is gone; a ``SNAPSHOT`` kill lands the
    moment the snapshot call after the step's ``optim_step`` has left for the ranks."""

    def __init__(self, m: hf.Mesh, kills: list[tuple[int, str, str, int]]) -> None:
        self.run_dir = m.run_dir
        self.kills = list(kills)
        self.done: list[dict[str, object]] = []
        self.now = (-1, "")
        send = m.controller._send

        def spy(*args: Any) -> None:
            send(*args)
            if self.now[1] == "optim_step" and args[2].body.get("method") == "snapshot":
                self._kill(self.now[0], SNAPSHOT)

        m.controller._send = spy  # type: ignore[method-assign,assignment]

    def __call__(self, step: int, call: str) -> None:
        self.now = (step, call)
        self._kill(step, call)

    def _kill(self, step: int, call: str) -> None:
        for when in [k for k in self.kills if k[:2] == (step, call)]:
            self.kills.remove(when)
            _, _, group, rank = when
            pid = self._pid(group, rank)
            os.kill(pid, signal.SIGKILL)
            self._gone(pid)
            self.done.append({"step": step, "before": call, "group": group, "rank": rank})

    def _pid(self, group: str, rank: int) -> int:
        ranks = json.loads((self.run_dir / "processes.json").read_text())["ranks"]
        (pid,) = [r["pid"] for r in ranks if (r["group"], r["rank"]) == (group, rank)]
        return int(pid)

    @staticmethod
    def _gone(pid: int, limit_s: float = 10.0) -> None:
        """Wait until ``pid`` is dead (a zombie its parent, the launcher, reaps, or gone)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1]
            except (OSError, IndexError):  # gone between open and read: ESRCH
                return
            if state in ("Z", "X"):
                return
            time.sleep(0.01)
        raise TimeoutError(f"pid {pid} still runs {limit_s:.0f} s after SIGKILL")


async def one_loop(work: Path, steps: int, kills: list[tuple[int, str, str, int]]) -> dict:
    run_dir = work / ("chaos" if kills else "calm")
    async with hf.mesh(QUICKSTART, *GROUPS, run_dir=run_dir) as m:
        chaos = Chaos(m, kills)
        began = time.perf_counter()
        rewards = await grpo_loop(m, steps, chaos, run_dir / "export")
        seconds = time.perf_counter() - began
        rollbacks = m.recovery.rollbacks if m.recovery is not None else 0
        version = m.version
    (weights,) = (run_dir / "export").glob("*.safetensors")
    return {
        "rewards": rewards,
        "weights": load_file(weights),
        "loop_s": seconds,
        "kills": chaos.done,
        "rollbacks": rollbacks,
        "version": version,
    }


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def compare(work: Path, steps: int) -> dict:
    calm = await one_loop(work, steps, [])
    chaos = await one_loop(work, steps, [k for k in KILLS if k[0] < steps])
    return {
        "api_chaos_equal": equal(calm["weights"], chaos["weights"])
        and calm["rewards"] == chaos["rewards"]
        and calm["version"] == chaos["version"] == steps,
        "api_chaos_kills": len(chaos["kills"]),
        "api_chaos_rollbacks": chaos["rollbacks"],
        "api_calm_loop_s": round(calm["loop_s"], 2),
        "api_chaos_loop_s": round(chaos["loop_s"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        found = hf.run(lambda: compare(Path(tmp), args.steps))
    print(json.dumps({"bench": "api_chaos", **found}))


if __name__ == "__main__":
    main()
