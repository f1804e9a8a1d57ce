"""Fixtures the role tests share."""

from __future__ import annotations

from typing import Any

import pytest

from roles.modeling.models import init_model, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny model's tokenizer (byte-level), made once per module."""
    return load_tokenizer(init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0))
