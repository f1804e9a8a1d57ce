"""The environment ``bench.agentic`` drives: every step is a tool call whose latency is drawn from a
heavy-tailed distribution (log-normal, median 50 ms, p99 1 s), simulated with a sleep in the env
group; with ``scale: 0`` it is the same environment answering at once (the limit).

The latency of a step depends only on the trajectory's row (its ``uid`` and ``seed``), the step's
index and the action's length, so the three runs of the benchmark (continuous, lock step, no
latency) see the same latencies for the same trajectories.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

MEDIAN_S = 0.05
P99_S = 1.0
Z99 = 2.3263478740408408  # the standard normal's 99th percentile
SIGMA = math.log(P99_S / MEDIAN_S) / Z99
STEPS = 8  # tool calls per trajectory (environment_args: steps)


def latency(key: str) -> float:
    """A log-normal draw (median ``MEDIAN_S``, p99 ``P99_S``) seeded by ``key``."""
    return random.Random(key).lognormvariate(math.log(MEDIAN_S), SIGMA)


class SlowTool:
    """``steps`` steps, each a tool call of drawn latency (times ``scale``: 0 answers at once);
    the observation is a short result."""

    def __init__(self, steps: int = STEPS, scale: float = 1.0) -> None:
        self.total, self.scale = steps, scale

    def reset(self, row: dict[str, Any]) -> str:
        self.key = f"{row.get('uid')}/{row.get('seed')}"
        self.steps = 0
        return ""

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        wait = self.scale * latency(f"{self.key}/{self.steps}/{len(action)}")
        if wait:
            time.sleep(wait)
        self.steps += 1
        return f" ->{len(action)}\n", 0.0, self.steps >= self.total, {}


async def slow_agent(client: Any, row: dict[str, Any]) -> float:
    """``SlowTool``'s task as an agent written against the OpenAI API: ``steps`` chat calls, each
    followed by a tool call of the same drawn latency (an ``asyncio.sleep``; the row's
    ``latency_scale``, 0: at once) whose short result goes back as a user message."""
    import asyncio

    key = f"{row.get('uid')}/{row.get('seed')}"
    scale = float(row.get("latency_scale", 1.0))
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    for step in range(int(row.get("steps", STEPS))):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content or ""
        wait = scale * latency(f"{key}/{step}/{len(text)}")
        if wait:
            await asyncio.sleep(wait)
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"->{len(text)}"},
        ]
    return 0.0
