"""The search tool: BM25 over a local document collection (the ``bm25s`` library).

The collection is a folder of ``.txt`` files (each file a document, its name the title; sub-folders
included) or a JSONL file with one ``{"title": ..., "text": ...}`` object a line. The env role
builds the index when it starts (``configure``, from its ``search_documents`` and
``search_top_k`` settings); ``search(query)`` then returns the best ``top_k`` documents with their
titles, each cut to ``snippet_chars``. Title and text are both indexed; English stop words are
dropped.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import bm25s


class SearchError(ValueError):
    """A document collection that cannot be read or searched."""


@dataclass(frozen=True)
class Document:
    title: str
    text: str


def load_documents(path: str | Path) -> list[Document]:
    """The documents of a folder of ``.txt`` files or of a JSONL file."""
    where = Path(path)
    if where.is_dir():
        files = sorted(where.rglob("*.txt"))
        return [
            Document(str(f.relative_to(where).with_suffix("")), f.read_text(errors="replace"))
            for f in files
        ]
    if where.is_file():
        return [_document(where, n, line) for n, line in _lines(where)]
    raise SearchError(f"search documents {where} is neither a folder of .txt files nor a file")


def _lines(path: Path) -> list[tuple[int, str]]:
    with path.open(errors="replace") as f:
        return [(n, line) for n, line in enumerate(f, 1) if line.strip()]


def _document(path: Path, number: int, line: str) -> Document:
    try:
        found = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SearchError(f"{path} line {number} is not JSON: {exc}") from None
    if not (isinstance(found, dict) and isinstance(found.get("text"), str)):
        raise SearchError(f'{path} line {number} needs an object with a "text" string')
    return Document(str(found.get("title") or f"{path.stem} {number}"), found["text"])


def _tokens(texts: list[str]) -> list[list[str]]:
    found: list[list[str]] = bm25s.tokenize(
        texts, stopwords="en", return_ids=False, show_progress=False
    )
    return found


class Index:
    """A BM25 index over ``documents``; ``search`` returns the best ``top_k`` as text."""

    def __init__(self, documents: list[Document], top_k: int = 3, snippet_chars: int = 600):
        if not documents:
            raise SearchError("the search collection holds no documents")
        if top_k < 1 or snippet_chars < 1:
            raise SearchError(f"top_k={top_k} and snippet_chars={snippet_chars} must be >= 1")
        self.documents, self.top_k, self.snippet_chars = documents, top_k, snippet_chars
        self.bm25 = bm25s.BM25()
        self.bm25.index(_tokens([f"{d.title}\n{d.text}" for d in documents]), show_progress=False)
        self._lock = threading.Lock()  # one retrieval at a time: the index is shared by workers

    def ranked(self, query: str) -> list[tuple[Document, float]]:
        """The matching documents, best first (at most ``top_k``; none when nothing matches)."""
        words = _tokens([query])
        if not words[0]:
            return []
        k = min(self.top_k, len(self.documents))
        with self._lock:
            found, scores = self.bm25.retrieve(words, k=k, show_progress=False)
        ranked = zip(found[0].tolist(), scores[0].tolist(), strict=True)
        return [(self.documents[i], float(score)) for i, score in ranked if score > 0]

    def search(self, query: str) -> str:
        ranked = self.ranked(query)
        if not ranked:
            return f"No document matches {query!r}."
        return "\n\n".join(
            f"[{n}] {doc.title}\n{self._snippet(doc.text)}" for n, (doc, _) in enumerate(ranked, 1)
        )

    def _snippet(self, text: str) -> str:
        text = text.strip()
        return text if len(text) <= self.snippet_chars else text[: self.snippet_chars] + " ..."


_index: Index | None = None


def configure(documents: str | Path, top_k: int = 3, snippet_chars: int = 600) -> Index:
    """Index the collection at ``documents`` for ``search`` in this process."""
    global _index
    _index = Index(load_documents(documents), top_k, snippet_chars)
    return _index


def search(query: str) -> str:
    """Search the document collection and return the best matching documents with their titles.

    Args:
        query: the words to look for, for example "capital of France".
    """
    if _index is None:
        raise SearchError(
            "the search tool has no documents; set the env role's search_documents to a folder "
            "of .txt files or a JSONL file"
        )
    return _index.search(query)
