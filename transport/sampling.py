"""Sampling settings of a ``generate`` call: the controller builds them, every generation engine
reads them (``roles/engines/generation/``: native, hf, vllm, sglang).

``SamplingConfig`` travels as a struct (``transport/structs.py``): it is validated when the
controller builds it and again when a rank receives it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingConfig(BaseModel):
    """How to sample: temperature, top-p/top-k, how many answers per prompt, their length,
    stop tokens and a seed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; 1: off")
    top_k: int = Field(0, ge=0, description="0: off")
    max_new_tokens: int = Field(64, ge=1)
    n: int = Field(1, ge=1, description="samples per prompt")
    stop_token_ids: list[int] | None = Field(
        None, description="tokens that end a sample (kept in it); default: the model's eos"
    )
    seed: int = Field(
        0,
        description="sample j of request i draws from (seed, i, j); i is the request's own "
        "seed when the batch has a 'seed' column, else its index in the call",
    )

    @model_validator(mode="after")
    def _greedy_is_single(self) -> SamplingConfig:
        if self.temperature == 0 and self.n > 1:
            raise ValueError(
                f"n={self.n} greedy samples of one prompt are identical; use temperature > 0"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
