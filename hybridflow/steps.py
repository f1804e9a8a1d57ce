"""What a step program of your own (``algorithm.program: package.module:function``) is written
with: the clients of the stage's roles, its state, and the pieces every built-in step is made of
(docs/api.md, "Your own step program"). The built-in programs (``controller/algorithms.py``) import
nothing else of the framework. Re-exports only."""

from controller.algorithm_config import AlgorithmConfig
from controller.steps import (
    Roles,
    State,
    Step,
    first_rows,
    group_ids,
    group_stats,
    kl_of,
    learn,
    log_probs,
    need,
    old_log_probs,
    reference,
    rewarded,
    scored,
    summarize,
    values,
    with_columns,
)

__all__ = [
    "AlgorithmConfig",
    "Roles",
    "State",
    "Step",
    "first_rows",
    "group_ids",
    "group_stats",
    "kl_of",
    "learn",
    "log_probs",
    "need",
    "old_log_probs",
    "reference",
    "rewarded",
    "scored",
    "summarize",
    "values",
    "with_columns",
]
