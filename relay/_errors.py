"""Errors of the relay (the whole tree: :mod:`ledgerbox._core.errors`).

Driver errors are translated only at the relay's seams: psycopg's into :class:`StoreError`
in the store, aiokafka's into :class:`PublishError` in the publisher; both carry the
:class:`~ledgerbox._core.faults.Fault` of the one classification table.
"""

from __future__ import annotations

from ledgerbox._core.errors import BrokerError, DatabaseError, LedgerboxError

__all__ = ["PublishError", "RelayError", "StoreError"]


class RelayError(LedgerboxError):
    """Root of the relay's errors."""

    __module__ = "ledgerbox.relay"


class StoreError(RelayError, DatabaseError):
    """A database call of the relay failed (``fault``, ``sqlstate``: see
    :class:`ledgerbox.DatabaseError`). The relay never exits on it: it backs off, reconnects
    and retries; an ``ENVIRONMENT`` fault turns its health to down with the cause."""

    __module__ = "ledgerbox.relay"


class PublishError(RelayError, BrokerError):
    """A Kafka send of the relay failed (``fault``, ``kind``: see
    :class:`ledgerbox.BrokerError`). ``MESSAGE``: the record is refused for good and is
    dead-lettered; otherwise the rows stay pending and are sent again (same key, same id)."""

    __module__ = "ledgerbox.relay"
