"""``hybridflow report RUN_DIR --html``: the run on one self-contained page, ``RUN_DIR/report.html``.

The page holds the summary ``hybridflow report`` prints (``deploy/reports/summary.py``), every
plot it drew (PNG files embedded as ``data:`` URIs, so the page can be mailed or attached on its
own) and the answers the trainer logged in ``samples.jsonl`` as a table (newest first). It needs no script, stylesheet or font
from elsewhere: the standard library writes it (``html.escape`` on every value).
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path

from controller.metrics import SAMPLES_FILE, Sample, read_samples

PAGE = "report.html"
MAX_SAMPLES = 1000  # newest first; a long run's file holds more than a page should
COLUMNS = ("step", "stage", "kind", "prompt", "response", "reward", "answer", "finish")
STYLE = """
body { font-family: sans-serif; margin: 2em; color: #222; }
pre.summary { background: #f5f5f5; padding: 1em; overflow-x: auto; }
figure { display: inline-block; margin: 0 1em 1em 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 90%; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; vertical-align: top; text-align: left; }
td.text { white-space: pre-wrap; font-family: monospace; max-width: 40em; }
th { background: #eee; }
"""


def write_html(run_dir: Path, text: str, plots: Sequence[Path]) -> Path:
    """Write ``RUN_DIR/report.html``: the summary ``text``, ``plots`` and the run's samples."""
    samples = read_samples(run_dir / SAMPLES_FILE)
    page = render(run_dir.name, text, plots, samples)
    path = run_dir / PAGE
    path.write_text(page, encoding="utf-8")
    return path


def render(title: str, text: str, plots: Sequence[Path], samples: Sequence[Sample]) -> str:
    """The page: title, summary, plots, samples table."""
    name = html.escape(title)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>hybridflow report: {name}</title><style>{STYLE}</style></head><body>",
        f"<h1>hybridflow report: {name}</h1>",
        f'<pre class="summary">{html.escape(text)}</pre>',
        "<h2>Plots</h2>",
        *(_figure(path) for path in plots if path.suffix == ".png"),
        "<h2>Samples</h2>",
        _samples_table(samples),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _figure(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    label = html.escape(path.stem)
    return (
        f'<figure><img alt="{label}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(path.name)}</figcaption></figure>"
    )


def _samples_table(samples: Sequence[Sample]) -> str:
    if not samples:
        return f"<p>No samples were logged ({SAMPLES_FILE}: trainer.log_samples).</p>"
    shown = list(reversed(samples))[:MAX_SAMPLES]
    columns = [c for c in COLUMNS if any(c in s for s in shown)]
    head = "".join(f"<th>{c}</th>" for c in columns)
    body = "\n".join(
        "<tr>" + "".join(_cell(column, s.get(column)) for column in columns) + "</tr>"
        for s in shown
    )
    note = f"<p>{len(shown)} of {len(samples)} samples, newest first.</p>"
    return (
        f'{note}<table id="samples"><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>'
    )


def _cell(column: str, value: object) -> str:
    if isinstance(value, float):
        return f"<td>{value:.4g}</td>"
    text = "" if value is None else str(value)
    kind = ' class="text"' if column in ("prompt", "response", "answer") else ""
    return f"<td{kind}>{html.escape(text)}</td>"
