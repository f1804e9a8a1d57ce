"""``engine: sglang`` for a rollout group: a warning that it never ran, and a refusal naming the
field and the missing package when sglang is not installed (``deploy/experiment.py``)."""

from __future__ import annotations

import importlib.util
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

import pytest
import yaml

import deploy.experiment
from deploy.experiment import ExperimentError, check, parse

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
WITH_SGLANG = [
    "roles.rollout={model: base, engine: sglang}",
    "placement.gen={roles: [rollout], nproc: 1}",
]


def quickstart() -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load(QUICKSTART.read_text())
    return raw


def sglang_installed(monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> ModuleSpec | None:
        if name == "sglang":
            return ModuleSpec("sglang", None) if installed else None
        return real(name, *args)

    monkeypatch.setattr(deploy.experiment.importlib.util, "find_spec", find_spec)


def test_sglang_without_the_package_is_refused_naming_the_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sglang_installed(monkeypatch, False)
    exp = parse(quickstart(), WITH_SGLANG)
    with pytest.warns(UserWarning, match="has never run"), pytest.raises(ExperimentError) as info:
        check(exp)
    message = str(info.value)
    assert message.startswith("roles.rollout.engine: ")
    assert "sglang package, which is not installed" in message
    assert "engine: native or vllm" in message


def test_sglang_with_the_package_passes_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    sglang_installed(monkeypatch, True)
    exp = parse(quickstart(), WITH_SGLANG)
    with pytest.warns(UserWarning, match=r"roles\.rollout\.engine: 'sglang' has never run"):
        check(exp)


def test_other_engines_raise_no_sglang_warning(recwarn: pytest.WarningsRecorder) -> None:
    check(parse(quickstart(), ["roles.rollout={model: base, engine: vllm}", WITH_SGLANG[1]]))
    assert not [w for w in recwarn if "sglang" in str(w.message)]
