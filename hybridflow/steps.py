"""What a step program of your own (``algorithm.program: package.module:function``) is written
with: the clients of the stage's roles, its state, and the pieces every built-in step is made of
(docs/api.md, "Your own step program"). Re-exports only."""

from controller.algorithm_config import AlgorithmConfig
from controller.algorithms import (
    Roles,
    State,
    group_ids,
    learn,
    log_probs,
    old_log_probs,
    rewarded,
    summarize,
    values,
    with_columns,
)

__all__ = [
    "AlgorithmConfig",
    "Roles",
    "State",
    "group_ids",
    "learn",
    "log_probs",
    "old_log_probs",
    "rewarded",
    "summarize",
    "values",
    "with_columns",
]
