"""verifiers environments as agents: ``env: {verifiers: module:load_environment}``.

Prime Intellect's ``verifiers`` package describes a task as a ``vf.Environment`` (single-turn,
multi-turn, tools) with a ``vf.Rubric`` that scores a finished rollout. Here such an environment
is one more agent of the env role (``roles/agents/host.py``): each trajectory runs the
environment's own ``rollout`` against the role's OpenAI-compatible endpoint, through verifiers'
own ``OpenAIChatCompletionsClient`` around the trajectory's client, so every model call is a turn
the run generates and records; then its rubric scores the rollout. The rubric's reward is the
trajectory's reward, its functions' values (and the environment's own counts, such as
``num_turns``) its metrics.

The stage's rows play the environment's dataset: a row's ``prompt`` is the question (after the
environment's ``system_prompt`` and ``few_shot`` messages, as verifiers formats a ``question``
column), its ``answer`` and ``info`` are passed on. The environment's own dataset is not
read. Sampling is the run's: the rollout asks for no temperature or length of its own.

Written against verifiers 0.3.1, whose classic environments (``vf.SingleTurnEnv``,
``vf.ToolEnv``, ``vf.MultiTurnEnv``) live in ``verifiers.legacy`` (0.4.0 replaced them and pins
``openai<3``). A rollout that ends in an error (the endpoint refused a call, a tool failed the
environment) raises, so the trajectory is a counted ``raised`` fault, not a zero reward. An empty
answer, which verifiers calls an error too, is the model's doing: it is scored.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import json
import math
from typing import Any

from transport.imports import import_path

INSTALL = "pip install --no-deps verifiers==0.3.1 (make installs it; docs/agents.md)"


def load_verifiers(path: str, args: dict[str, Any], build: bool = True) -> Any:
    """The environment ``path`` (``module:load_environment``) builds with ``args``; a
    ValueError naming what is missing or wrong (the package, the function, its return).
    ``build=False``: the package and the function checked, nothing built (None)."""
    if importlib.util.find_spec("verifiers") is None:
        raise ValueError(f"verifiers {path!r} needs the 'verifiers' package: {INSTALL}")
    import verifiers as vf

    make = import_path(path, "verifiers", "function", callable)
    if not build:
        return None
    try:
        env = make(**args)
    except TypeError as exc:
        raise ValueError(f"verifiers {path!r} with verifiers_args {args}: {exc}") from None
    if inspect.isawaitable(env):
        raise ValueError(f"verifiers {path!r} returned an awaitable; give a plain function")
    if not isinstance(env, vf.Environment):
        raise ValueError(
            f"verifiers {path!r} returned a {type(env).__name__}, not a vf.Environment "
            "(vf.SingleTurnEnv, vf.MultiTurnEnv, vf.ToolEnv)"
        )
    return env


class VerifiersAgent:
    """An agent function (``async def (client, row)``) that runs a verifiers environment's
    rollout and returns its rubric's reward and metrics."""

    def __init__(self, env: Any, model: str) -> None:
        self.env, self.model = env, model
        self.ids = itertools.count()  # each rollout's example_id (verifiers' bookkeeping only)

    def rollout_input(self, row: dict[str, Any], example_id: int) -> dict[str, Any]:
        """A stage row as the environment's dataset row: ``prompt`` as verifiers formats a
        ``question`` (system prompt, few-shot messages, the user's turn)."""
        messages: list[dict[str, Any]] = []
        system = getattr(self.env, "system_prompt", None)
        if system:
            messages.append({"role": "system", "content": system})
        messages += list(getattr(self.env, "few_shot", None) or [])
        prompt = row.get("prompt")
        if isinstance(prompt, list):  # already chat messages
            messages += prompt
        else:
            messages.append({"role": "user", "content": str(prompt)})
        info = row.get("info", {})
        return {
            "prompt": messages,
            "answer": "" if row.get("answer") is None else str(row["answer"]),
            "info": json.loads(info) if isinstance(info, str) else dict(info or {}),
            "example_id": example_id,
        }

    async def __call__(self, client: Any, row: dict[str, Any]) -> dict[str, float]:
        import verifiers as vf

        state = await self.env.rollout(
            self.rollout_input(row, next(self.ids)),
            vf.OpenAIChatCompletionsClient(client),
            self.model,
        )
        if isinstance(state.get("error"), vf.EmptyModelResponseError):
            state["error"] = None  # the model said nothing: its answer, scored like any other
        if state.get("error") is None:
            await self.env.rubric.score_rollout(state)
        error = state.get("error")
        if error is not None:  # verifiers keeps going on an error; here it ends the trajectory
            raise RuntimeError(f"the verifiers rollout failed: {type(error).__name__}: {error}")
        found = {"reward": float(state["reward"])}
        for name, value in (state.get("metrics") or {}).items():
            if isinstance(value, int | float) and math.isfinite(value):
                found[f"vf/{name}"] = float(value)
        return found
