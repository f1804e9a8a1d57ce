"""``hf.Datum`` rows into the training layout (``hf.batch_of``), by hand: prompt then response,
right-padded; the loss inputs at the response positions; a bad row named with its field."""

from __future__ import annotations

import pytest
import torch

import hybridflow as hf


def test_rows_become_the_training_layout() -> None:
    rows = [
        hf.Datum(prompt=[5, 6], response=[7], advantages=0.5, old_log_probs=[-1.0], weights=2.0),
        hf.Datum(
            prompt=[8],
            response=[9, 10, 11],
            advantages=[1.0, 2.0, 3.0],
            old_log_probs=[-0.1, -0.2, -0.3],
            weights=[1.0, 0.0, 1.0],
        ),
    ]
    batch = hf.batch_of(rows, pad_id=3)
    assert batch.tensors["input_ids"].tolist() == [[5, 6, 7, 3], [8, 9, 10, 11]]
    assert batch.tensors["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch.tensors["response_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 1, 1]]
    assert batch.tensors["advantages"].tolist() == [[0, 0, 0.5, 0], [0, 1, 2, 3]]
    assert torch.allclose(
        batch.tensors["old_log_probs"], torch.tensor([[0, 0, -1.0, 0], [0, -0.1, -0.2, -0.3]])
    )
    assert batch.tensors["weights"].tolist() == [[0, 0, 2, 0], [0, 1, 0, 1]]
    assert batch.meta["pad_values"] == {"input_ids": 3}


def test_rows_without_loss_inputs_carry_the_tokens_alone() -> None:
    batch = hf.batch_of([hf.Datum(prompt=[1], response=[2])])
    assert set(batch.tensors) == {"input_ids", "attention_mask", "response_mask"}


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "no rows"),
        ([hf.Datum(prompt=[1], response=[])], "row 0: response is empty"),
        # the first response token would have no token before it to be predicted from
        ([hf.Datum([1], [2]), hf.Datum(prompt=[], response=[2])], "row 1: prompt is empty"),
        (
            [hf.Datum([1], [2], advantages=1.0), hf.Datum([1], [2])],
            "row 1: advantages is missing; give it on every row or none",
        ),
        (
            [hf.Datum([1], [2, 3], old_log_probs=[-1.0])],
            "row 0: old_log_probs has 1 values for 2 response tokens",
        ),
    ],
)
def test_a_bad_row_is_named_with_its_field(rows: list[hf.Datum], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hf.batch_of(rows)


def test_a_sampled_batch_becomes_rows_and_back() -> None:
    """``hf.datums``: a batch as ``sample`` returns it (prompts left-padded, responses then
    right padding) as ``Datum`` rows, with one advantage per row and log-probs per position."""
    ids = torch.tensor([[0, 1, 5, 7, 9, 2], [1, 6, 6, 8, 0, 0]])
    attention = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    response = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 0, 0]])
    logp = torch.arange(12, dtype=torch.float32).reshape(2, 6) / -10
    batch = hf.TensorBatch.from_dict(
        {"input_ids": ids, "attention_mask": attention, "response_mask": response}
    )
    rows = hf.datums(batch, advantages=torch.tensor([0.5, -1.0]), old_log_probs=logp)
    assert rows == [
        hf.Datum(
            [1, 5], [7, 9, 2], advantages=0.5, old_log_probs=pytest.approx([-0.3, -0.4, -0.5])
        ),
        hf.Datum([1, 6, 6], [8], advantages=-1.0, old_log_probs=pytest.approx([-0.9])),
    ]
    again = hf.batch_of(rows)
    assert again.tensors["input_ids"].tolist() == [[1, 5, 7, 9, 2], [1, 6, 6, 8, 0]]
    gaps = batch.tensors["response_mask"].clone()
    gaps[0, 4] = 0  # an observation token inside a multi-turn response
    batch.tensors["response_mask"] = gaps
    with pytest.raises(ValueError, match="row 0: its response_mask has gaps"):
        hf.datums(batch)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
        hf.datums(batch, advantages=torch.zeros(3))


def test_rows_of_a_sampled_batch_keep_its_temperature() -> None:
    """The sampler's log-probs are at the sampling temperature: rows made from its batch train
    at it (they trained at 1 against log-probs taken at 0.7); rows of two temperatures are
    refused, and a temperature given to the call is what counts."""
    from deploy.mesh import temperature_of

    ids = torch.tensor([[1, 5, 7], [1, 6, 8]])
    batch = hf.TensorBatch(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {}, {"temperature": 0.7}
    )
    batch.tensors["response_mask"] = torch.tensor([[0, 0, 1], [0, 1, 1]])
    rows = hf.datums(batch, old_log_probs=torch.zeros(2, 3) - 1.0)
    assert [r.temperature for r in rows] == [0.7, 0.7]
    assert hf.batch_of(rows).meta["temperature"] == 0.7
    assert temperature_of(rows, None) == 0.7 and temperature_of(rows, 1.0) == 1.0
    assert temperature_of([hf.Datum([1], [2])], None) == 1.0  # rows of no sample: 1
    mixed = [hf.Datum([1], [2], temperature=0.7), hf.Datum([1], [2], temperature=1.0)]
    with pytest.raises(ValueError, match=r"row 1: temperature 1\.0 is not row 0's 0\.7"):
        hf.batch_of(mixed)
