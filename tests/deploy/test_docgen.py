"""docs/experiments.md's field reference is what ``python -m deploy.docgen`` generates from the
models now: a field added, renamed or re-described without rerunning it fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

import deploy.docgen as docgen
from controller.trainer import TrainerConfig


def test_the_committed_reference_is_what_the_models_generate() -> None:
    lines: list[str] = []
    assert docgen.main(["--check"], write=lines.append) == 0, (
        "docs/experiments.md is stale: run python -m deploy.docgen"
    )


def test_the_reference_lists_every_field_including_the_ones_hand_written_docs_forgot() -> None:
    text = docgen.generate()
    for field in ("pp", "gen_tp", "gen_pp", "prompt_template", "log_samples", "import_root"):
        assert f"| `{field}` |" in text
    for name in TrainerConfig.model_fields:
        assert f"| `{name}` |" in text
    assert "#### `builtin:arithmetic?...`" in text and "| `max_operand` | int | `99` |" in text
    assert "| `prompt_key` | `prompt` |" in text


def test_notes_name_fields_that_exist_and_have_no_description_of_their_own() -> None:
    models = {}
    for _, _, model in docgen.sections():
        models[model.__name__] = model
        for field in model.model_fields.values():
            for inner in docgen._models_in(field.annotation):
                models.setdefault(inner.__name__, inner)
                for deeper in inner.model_fields.values():
                    for m in docgen._models_in(deeper.annotation):
                        models.setdefault(m.__name__, m)
    for model_name, field_name in docgen.NOTES:
        assert model_name in models, f"NOTES names a model the reference has not: {model_name}"
        field = models[model_name].model_fields.get(field_name)
        assert field is not None, f"NOTES names a field that is gone: {model_name}.{field_name}"
        assert not field.description, f"{model_name}.{field_name} has its own description now"


def test_a_stale_reference_is_caught_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = tmp_path / "experiments.md"
    stale = docgen.DOC.read_text(encoding="utf-8").replace("| `gen_pp` |", "| `gen_ppx` |")
    doc.write_text(stale, encoding="utf-8")
    monkeypatch.setattr(docgen, "DOC", doc)
    lines: list[str] = []
    assert docgen.main(["--check"], write=lines.append) == 1 and "stale" in lines[-1]
    assert doc.read_text(encoding="utf-8") == stale  # --check writes nothing
    assert docgen.main([], write=lines.append) == 0
    assert docgen.main(["--check"], write=lines.append) == 0
    doc.write_text("no markers here\n", encoding="utf-8")
    with pytest.raises(ValueError, match="needs exactly one"):
        docgen.main([], write=lines.append)
