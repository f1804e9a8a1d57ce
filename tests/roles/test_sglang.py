"""The ``sglang`` engine's pieces that run without SGLang (``roles/engines/generation/sglang.py``
itself has never run: no SGLang build installs here): the error that names what to install, the
sampling settings each sample gets, and reading SGLang 0.5.23's generate output."""

from __future__ import annotations

import builtins
from typing import Any

import pytest

from roles.engines.generation.interface import GenerationError, Sample, SamplingConfig
from roles.engines.generation.sglang import SGLangEngine, _fill, import_sglang


def test_missing_sglang_names_the_version_the_adapter_was_written_against(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = builtins.__import__

    def no_sglang(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "sglang" or name.startswith("sglang."):
            raise ImportError("No module named 'sglang'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sglang)
    with pytest.raises(GenerationError, match=r"SGLang 0\.5\.23 and has never run"):
        import_sglang()


def test_each_sample_asks_for_our_stops_kept_and_its_own_seed() -> None:
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=8)
    params = SGLangEngine._params(sampling, [258, 7], seed=2**64 + 5)
    assert params["top_k"] == -1  # SGLang's "whole vocabulary"
    assert params["stop_token_ids"] == [258, 7] and params["ignore_eos"]
    assert params["no_stop_trim"] and params["n"] == 1
    assert params["sampling_seed"] == 5  # folded into int64


def test_generate_output_becomes_a_sample() -> None:
    out = {
        "output_ids": [5, 9, 258],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 258},
            "output_token_logprobs": [(-0.5, 5, None), (-1.25, 9, None), (-0.125, 258, None)],
        },
    }
    sample = Sample(request=0, prompt=[1, 2])
    _fill(sample, out)
    assert (sample.tokens, sample.log_probs, sample.finish) == (
        [5, 9, 258],
        [-0.5, -1.25, -0.125],
        "stop",
    )
    aborted = {**out, "meta_info": {**out["meta_info"], "finish_reason": {"type": "abort"}}}
    with pytest.raises(GenerationError, match="abort"):
        _fill(Sample(request=0, prompt=[1]), aborted)
