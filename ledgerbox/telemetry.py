"""Tracing setup: an OpenTelemetry SDK from the standard ``OTEL_*`` variables.

The daemons (``ledgerbox relay run``, ``ledgerbox consumer run``) call :func:`configure` at
start; a service embedding ledgerbox may call it too, or configure its own SDK (ledgerbox's
spans then go to that provider). Variables, exporters and the JSON-lines file exporter:
:mod:`ledgerbox._core.telemetry` and docs/observability.md, "Export".
"""

from ledgerbox._core.telemetry import FILE_EXPORTER, configure, shutdown

__all__ = ["FILE_EXPORTER", "configure", "shutdown"]
