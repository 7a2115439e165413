"""``ledgerbox consumer dlq list|show|replay|discard`` and ``ledgerbox consumer lag``."""

from __future__ import annotations

from ledgerbox.inbox._cli import app as consumer_app

__all__ = ["consumer_app"]
