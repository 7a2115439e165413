"""A span exporter that appends one JSON object per finished span to a file (JSON lines).

For the demo and for debugging without a collector: ``OTEL_TRACES_EXPORTER=ledgerbox_file``
with ``LEDGERBOX_OTEL_FILE=/path/spans.jsonl`` (docs/observability.md, "Export"). Needs the
``otel`` extra (the SDK); imported only when that exporter is chosen.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["JsonLinesSpanExporter"]


class JsonLinesSpanExporter(SpanExporter):
    """Append each exported span as one line of JSON (``ReadableSpan.to_json``) to ``path``.

    Parameters
    ----------
    path : str | Path
        The file; created if missing, appended to otherwise (parent directory must exist).

    Guarantee: a line is written and flushed per span before :meth:`export` returns
    ``SUCCESS``; an ``OSError`` makes it return ``FAILURE`` (the SDK logs it; spans are
    never worth stopping a daemon).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(json.loads(s.to_json(indent=None))) + "\n" for s in spans)
        try:
            with self._lock, self.path.open("a", encoding="utf-8") as out:
                out.write(lines)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None
