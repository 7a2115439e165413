"""Tracing setup for the daemons: an OpenTelemetry SDK from the standard ``OTEL_*`` variables.

``ledgerbox relay run`` and ``ledgerbox consumer run`` call :func:`configure` at start: when
``OTEL_TRACES_EXPORTER`` or an OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, it installs a global SDK tracer provider with
a batch span processor and the chosen exporters; otherwise nothing (and no span is built:
docs/observability.md, "Cost"). An application embedding ledgerbox that configures its own
SDK needs none of this: ledgerbox's spans go to whatever global provider is set.

Variables (OpenTelemetry SDK environment specification,
https://opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/):
``OTEL_SDK_DISABLED``, ``OTEL_TRACES_EXPORTER`` (comma list of ``otlp``, ``console``,
``ledgerbox_file``, ``none``; default ``otlp`` when an endpoint is set),
``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (``http/protobuf``,
the default, or ``grpc`` if its exporter package is installed), ``OTEL_EXPORTER_OTLP_*``
(endpoint, headers, timeout: read by the exporter), ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER[_ARG]``, ``OTEL_BSP_*``. ledgerbox's own:
``LEDGERBOX_OTEL_FILE``, the JSON-lines file of the ``ledgerbox_file`` exporter.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ledgerbox._core.errors import ConfigurationError

__all__ = ["FILE_EXPORTER", "configure", "shutdown"]

#: The ``OTEL_TRACES_EXPORTER`` name of ledgerbox's JSON-lines file exporter.
FILE_EXPORTER = "ledgerbox_file"

_INSTALLED: Any = None  # the SDK provider configure() installed (shutdown() flushes it)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def configure(service_name: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Install a global SDK tracer provider if the environment asks for spans.

    Parameters
    ----------
    service_name : str
        ``service.name`` unless ``OTEL_SERVICE_NAME`` (or ``service.name`` in
        ``OTEL_RESOURCE_ATTRIBUTES``) says otherwise, e.g. ``"ledgerbox-relay"``.
    environ : Mapping[str, str] | None
        The variables to read (default ``os.environ``; the OTLP exporter itself always reads
        ``os.environ`` for its endpoint, headers and timeout).

    Returns
    -------
    bool
        ``True`` if a provider was installed; ``False`` when no exporter is asked for, the
        SDK is disabled, ``none`` is chosen, or a global SDK provider is already set.

    Raises
    ------
    ConfigurationError
        An exporter is asked for but ``ledgerbox[otel]`` (or the grpc exporter) is not
        installed, an exporter name is unknown, or ``ledgerbox_file`` lacks
        ``LEDGERBOX_OTEL_FILE``. One line with the fix.
    """
    global _INSTALLED
    env = os.environ if environ is None else environ
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )
    if not names and endpoint:
        names = ["otlp"]
    if not names or names == ["none"] or _truthy(env.get("OTEL_SDK_DISABLED")):
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
    except ImportError:
        raise ConfigurationError(
            "OTEL_TRACES_EXPORTER/OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not "
            "installed: pip install 'ledgerbox[otel]' (or unset them)"
        ) from None
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return False  # the application configured its own SDK
    exporters: list[SpanExporter] = [_exporter(name, env) for name in names if name != "none"]
    # Resource.create reads OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME (os.environ); the
    # attributes given here would win over them, so the default name only when they are unset.
    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    resource = Resource.create({} if named else {SERVICE_NAME: service_name})
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _INSTALLED = provider
    return True


def shutdown() -> None:
    """Flush and stop the provider :func:`configure` installed (no-op otherwise); call it
    once when the daemon stops, so that the last batch of spans is exported."""
    global _INSTALLED
    provider, _INSTALLED = _INSTALLED, None
    if provider is not None:
        provider.shutdown()


def _exporter(name: str, env: Mapping[str, str]) -> Any:
    if name == "otlp":
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
        )
        try:
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcExporter,
                )

                return GrpcExporter()
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter()
        except ImportError:
            kind = "grpc" if protocol == "grpc" else "http"
            package = f"opentelemetry-exporter-otlp-proto-{kind}"
            raise ConfigurationError(
                f"OTLP over {protocol} asked for but {package} is not installed: "
                f"pip install 'ledgerbox[otel]' (http/protobuf) or pip install {package}"
            ) from None
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name == FILE_EXPORTER:
        path = env.get("LEDGERBOX_OTEL_FILE")
        if not path:
            raise ConfigurationError(
                f"OTEL_TRACES_EXPORTER={FILE_EXPORTER} needs LEDGERBOX_OTEL_FILE=<path of the "
                "JSON-lines file>"
            )
        from ledgerbox._core.span_file import JsonLinesSpanExporter

        return JsonLinesSpanExporter(path)
    raise ConfigurationError(
        f"OTEL_TRACES_EXPORTER: unknown exporter {name!r}: use otlp, console, {FILE_EXPORTER} "
        "or none"
    )
