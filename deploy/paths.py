"""Where an experiment's relative paths are read from: the experiment file's own folder, the
working directory a noted fallback (``anchor_paths``), and how a "not found" says where it
looked (``looked_in``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.data import BUILTIN

#: per section, the fields that name a file or folder (data sources may add ``?key=column``)
PATH_FIELDS = {
    "models": ("path",),
    "roles": ("model", "tokenizer", "search_documents"),
    "stages": ("data", "val_data", "ptx_data"),
    "trainer": ("val_data",),
}


def anchor_paths(raw: dict[str, Any], folder: Path) -> list[str]:
    """Each relative path of the file's ``PATH_FIELDS`` made absolute from ``folder``, the
    experiment's own, so a run does not depend on where it was started. One found only from the
    working directory is taken from there, with a note (returned) that this fallback will go;
    one found in neither is left as written (a Hugging Face hub id, or a "not found" later that
    names both folders). A role's ``model`` that names an entry of ``models`` is not a path."""
    notes: list[str] = []
    names = set(raw.get("models") or {})

    def anchored(value: Any, field: str) -> Any:
        if not isinstance(value, str) or value.startswith(BUILTIN) or Path(value).is_absolute():
            return value
        file, sep, query = value.partition("?")
        if (folder / file).exists():
            return f"{folder / file}{sep}{query}"
        if Path(file).exists():
            notes.append(
                f"{field}: {file!r} is read from the working directory ({Path.cwd()}), not from "
                f"the experiment's folder ({folder}); relative paths are the experiment "
                "folder's, and this fallback will go: write the path from there"
            )
            return f"{Path(file).resolve()}{sep}{query}"
        return value

    for section, fields in PATH_FIELDS.items():
        entries = raw.get(section)
        items: list[tuple[Any, Any]]
        if section == "trainer":
            items = [("", entries)]
        elif isinstance(entries, dict):
            items = list(entries.items())
        else:
            items = list(enumerate(entries if isinstance(entries, list) else []))
        for key, entry in items:
            if not isinstance(entry, dict):
                continue
            for name in fields:
                if name not in entry or (section == "roles" and entry[name] in names):
                    continue
                where = f"{section}.{key}.{name}" if key != "" else f"{section}.{name}"
                entry[name] = anchored(entry[name], where)
    return notes


def looked_in(folder: str | None) -> str:
    """Where a relative path was looked for, in words."""
    here = f"the working directory {Path.cwd()}"
    return f"looked for in the experiment's folder {folder} and in {here}" if folder else here
