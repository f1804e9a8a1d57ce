"""bench/real_vs_trl.py runs both sides in one dtype: ``--dtype auto`` is resolved once, by
hybridflow's own rule, and that one value goes to hybridflow's actor and to TRL's ``bf16=``."""

from __future__ import annotations

import pytest

from bench.real_vs_trl import both_sides_dtype
from roles.runtime.device import AUTO_DTYPE_ENV, HOST_DEVICE, choose_dtype


def test_auto_is_what_hybridflow_picks_here_and_explicit_dtypes_are_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    assert both_sides_dtype("auto")[0] == choose_dtype("auto", HOST_DEVICE).dtype
    assert both_sides_dtype("fp32") == ("fp32", "set in the config")
    assert both_sides_dtype("bf16")[0] == "bf16"
    monkeypatch.setenv(AUTO_DTYPE_ENV, "fp32")  # as a host without AMX resolves it
    assert both_sides_dtype("auto") == ("fp32", f"auto: {AUTO_DTYPE_ENV}=fp32")
