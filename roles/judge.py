"""An LLM as the reward: a generative model, served by a generation engine, reads each
(prompt, response) through a prompt template and answers with a verdict that is parsed into a
score. The design's "swap serving backends per role" applied to rewards: ``engine: native``,
``hf`` or ``vllm``, as for a rollout group.

``reward: {cls: roles.judge:JudgeReward, model: M, template: "...", verdict: {...}}``:

* ``template``: Python format text with ``{prompt}``, ``{response}`` and any column of the row
  (``{answer}``); ``chat: true`` wraps it as one user message in the judge's chat template;
* ``verdict``: ``{kind: number, low: 0, high: 10}`` takes the first number of the judge's
  answer, which must lie in [low, high], scaled to [0, 1]; ``{kind: choice, choices: {"yes": 1,
  "no": 0}}`` takes the first choice the answer holds, as written (case-insensitive, spaces and
  punctuation included, never inside a longer word, the longest of those at one place: ``not
  sure`` before ``not``); quote yes and no in YAML, which reads them bare as booleans;
* a verdict that does not parse (no number, a number out of range, no choice word) scores
  ``malformed`` (0 by default) and is counted: ``reward/judge_malformed`` is 1 on that row, so
  its batch mean is the fraction of malformed verdicts. The judge answers greedily, one batched
  generation call per scoring call on each rank.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from roles.base import Role, RoleContext
from roles.engines.generation.serve import EngineName, make_engine, serve
from roles.engines.generation.vllm import DEFAULT_KV_CACHE_MB
from roles.modeling.models import load_causal_lm, load_tokenizer
from roles.reward import RewardError, metadata, text_rows
from roles.runtime.device import Precision, group_dtype
from roles.runtime.endpoint import DP_SPLIT, endpoint
from transport.batch import TensorBatch
from transport.sampling import SamplingConfig

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class Verdict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["number", "choice"] = Field(description="a number in [low, high], or a choice")
    low: float = Field(0.0, description="number: the lowest valid verdict (scored 0)")
    high: float = Field(1.0, description="number: the highest valid verdict (scored 1)")
    choices: dict[str, float] = Field(
        default_factory=dict,
        description="choice: text -> score, e.g. {yes: 1, no: 0, 'not sure': 0.5}; matched as "
        "written (case-insensitive), not inside a longer word, the longest at a place first",
    )
    _choice: re.Pattern[str] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _complete(self) -> Verdict:
        if self.kind == "number" and not self.high > self.low:
            raise ValueError(f"verdict high={self.high} must be above low={self.low}")
        if self.kind == "choice" and not self.choices:
            raise ValueError("verdict kind choice needs choices, e.g. {yes: 1.0, no: 0.0}")
        self.choices = {k.lower(): v for k, v in self.choices.items()}
        if self.choices:  # the longest first, so "not sure" is found before "not"
            texts = sorted(self.choices, key=len, reverse=True)
            either = "|".join(re.escape(t) for t in texts)
            self._choice = re.compile(rf"(?<!\w)(?:{either})(?!\w)")
        return self

    def parse(self, text: str) -> float | None:
        """The verdict's score, or None when ``text`` holds no valid verdict."""
        if self.kind == "number":
            found = _NUMBER.search(text)
            if found is None:
                return None
            value = float(found.group())
            if not self.low <= value <= self.high:
                return None
            return (value - self.low) / (self.high - self.low)
        found = self._choice.search(text.lower()) if self._choice is not None else None
        return None if found is None else self.choices[found.group()]


class JudgeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the judge's model folder (any causal LM)")
    template: str = Field(
        description="the judge's prompt: format text with {prompt}, {response} and row columns"
    )
    verdict: Verdict
    malformed: float = Field(0.0, description="the score of a verdict that does not parse")
    chat: bool = Field(False, description="wrap the prompt as a user message (chat template)")
    engine: EngineName = Field("native", description="native, hf or vllm")
    max_new_tokens: int = Field(8, ge=1, description="tokens the judge may answer with")
    dtype: Precision = "auto"
    kv_cache_mb: float = Field(DEFAULT_KV_CACHE_MB, gt=0, description="engine vllm: KV cache")

    @model_validator(mode="after")
    def _served(self) -> JudgeConfig:
        if self.engine == "sglang":
            raise ValueError("engine: a judge runs on native, hf or vllm")
        return self


def judge_prompt(cfg: JudgeConfig, tokenizer: Any, row: int, fields: dict[str, Any]) -> str:
    """The judge's prompt for one row: the template filled with the row's ``fields`` (its
    prompt, response and columns), as one user message of the chat template with ``chat``."""
    try:
        text = cfg.template.format(**fields)
    except (KeyError, IndexError) as exc:
        raise RewardError(
            f"judge template names {exc} but row {row} has only {sorted(fields)}"
        ) from None
    if not cfg.chat:
        return text
    message = [{"role": "user", "content": text}]
    return str(tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True))


class JudgeReward(Role):
    """Scores rows by asking a generative model (module docstring)."""

    def __init__(self, ctx: RoleContext, **config: Any) -> None:
        super().__init__(ctx)
        self.cfg = JudgeConfig.model_validate(config)
        self.tokenizer = load_tokenizer(self.cfg.model)
        dtype = group_dtype(self.cfg.dtype, ctx.device, ctx.process_group).torch_dtype
        if self.cfg.engine == "vllm":
            from roles.rollout import vllm_engine

            self.engine = vllm_engine(
                self.cfg.model, self.tokenizer, dtype, 1, self.cfg.kv_cache_mb
            )
        else:
            model = load_causal_lm(self.cfg.model, dtype=dtype)
            model = model.to(ctx.device.device).eval()  # type: ignore[arg-type]
            self.engine = make_engine(self.cfg.engine, model, self.tokenizer)

    @endpoint(DP_SPLIT)
    def compute_reward(self, batch: TensorBatch) -> TensorBatch:
        """``scores`` ``[B]``, ``reward/judge_malformed`` (1 where the verdict did not parse) and
        each row's ``verdict``, the judge's answer as it wrote it (logged with the samples)."""
        prompts, responses = text_rows(batch, self.tokenizer)
        asked = [
            judge_prompt(
                self.cfg, self.tokenizer, i, {**metadata(batch, i), "prompt": p, "response": r}
            )
            for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
        ]
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=self.cfg.max_new_tokens)
        with torch.no_grad():
            out = serve(
                self.engine,
                self.tokenizer,
                TensorBatch.from_dict(non_tensors={"prompt": asked}),
                sampling,
                0,
            )
        by_request = dict(zip(out.non_tensors["request"], out.non_tensors["response"], strict=True))
        parsed = [self.cfg.verdict.parse(by_request[i]) for i in range(len(asked))]
        scores = [self.cfg.malformed if p is None else p for p in parsed]
        return TensorBatch.from_dict(
            {
                "scores": torch.tensor(scores, dtype=torch.float32),
                "reward/judge_malformed": torch.tensor([float(p is None) for p in parsed]),
            },
            {"verdict": [by_request[i] for i in range(len(asked))]},  # what the judge said
        )
