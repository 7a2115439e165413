"""Plain-text and JSON output of the operator commands (no heavy imports)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import typer

__all__ = ["log_actions", "print_json", "quiet_kafka_client", "short", "table"]


def print_json(value: Any) -> None:
    """One indented JSON document on stdout."""
    typer.echo(json.dumps(value, indent=2, sort_keys=True))


def table(rows: list[list[str]]) -> None:
    """``rows`` (the first: the header) as left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def short(text: str | None, width: int = 60) -> str:
    """``text`` on one line, cut to ``width`` characters (``-`` for none)."""
    one = " ".join((text or "-").split())
    return one if len(one) <= width else one[: width - 3] + "..."


def log_actions() -> None:
    """Send the operator action lines (logger ``ledgerbox.admin``, INFO) to stderr, once:
    stdout keeps only the command's output (``--json`` stays parseable)."""
    log = logging.getLogger("ledgerbox.admin")
    if not any(getattr(h, "ledgerbox_cli", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        handler.ledgerbox_cli = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def quiet_kafka_client() -> None:
    """Keep the Kafka client's own log lines (``aiokafka``: "Unable connect to ...") off
    stderr in an operator command: without a configured handler Python prints them through
    its last-resort handler, before the command's one line, which already names the failure
    (the client's error is translated into ``ledgerbox.BrokerError``). A handler configured
    on the root logger still receives them."""
    log = logging.getLogger("aiokafka")
    if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
        log.addHandler(logging.NullHandler())
