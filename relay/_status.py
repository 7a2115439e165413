"""The relay config of the commands that touch the database only (``relay status``,
``relay rebase``, the operator API of ``ledgerbox.admin``): ``RelayConfig`` requires a Kafka
address, which these never use, so they pass this one placeholder instead of each its own."""

from __future__ import annotations

__all__ = ["UNUSED_KAFKA"]

#: A Kafka address the database-only commands never connect to.
UNUSED_KAFKA = "unused-by-database-commands:9092"
