"""Errors of the relay, below ``outbox.LedgerboxError``.

::

    LedgerboxError
    └── RelayError                 the relay could not do something (see subclasses)
        └── StoreError             a database call failed; ``transient`` says whether to retry

Driver errors (psycopg) are translated into :class:`StoreError` only in ``relay._store``,
classified by SQLSTATE, never by message text. Kafka errors are classified by class in
``relay._policy``.
"""

from __future__ import annotations

from ledgerbox._core.errors import LedgerboxError

__all__ = ["RelayError", "StoreError"]


class RelayError(LedgerboxError):
    """Root of the relay's errors."""

    __module__ = "ledgerbox.relay"


class StoreError(RelayError):
    """A database call of the relay failed.

    Attributes
    ----------
    sqlstate : str | None
        The SQLSTATE of the server error, ``None`` for a client-side failure (connection lost).
    transient : bool
        ``True`` if retrying after a pause can succeed (connection errors, class 08, 40001,
        40P01, 57P0x, 53xxx, 55P03); ``False`` for schema or permission errors.
    """

    __module__ = "ledgerbox.relay"

    def __init__(self, message: str, *, sqlstate: str | None, transient: bool) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.transient = transient
