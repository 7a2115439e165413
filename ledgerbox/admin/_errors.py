"""Errors of the operator API (:mod:`ledgerbox.admin`)::

    ledgerbox.LedgerboxError
    └── ledgerbox.admin.AdminError          an operator action cannot be done as asked
        ├── InvalidFilterError              a bad filter, reference, or ids and filter mixed
        ├── NotFoundError                   an unknown or not dead-lettered id, an unknown ref
        └── RefusedError                    not allowed on that item (discarded, no group)

Database and Kafka failures stay :class:`ledgerbox.DatabaseError` and
:class:`ledgerbox.BrokerError`. Every message is one line: the cause and the fix.
"""

from __future__ import annotations

from ledgerbox._core.errors import ConfigurationError, LedgerboxError

__all__ = ["AdminError", "InvalidFilterError", "NotFoundError", "RefusedError"]


class AdminError(LedgerboxError):
    """Root of the operator API's expected failures (the CLI exits 2 with its message)."""

    __module__ = "ledgerbox.admin"


class InvalidFilterError(AdminError, ConfigurationError):
    """A filter value, a DLQ reference or the choice of ids/filter is invalid.

    ``setting`` names the field at fault (``"older_than_s"``, ``"ref"``, ...)."""

    __module__ = "ledgerbox.admin"

    def __init__(self, message: str, *, setting: str | None = None) -> None:
        ConfigurationError.__init__(self, message, setting=setting)


class NotFoundError(AdminError):
    """An outbox row id that is not dead-lettered (or does not exist), or a DLQ reference
    past the end of its partition; nothing was changed."""

    __module__ = "ledgerbox.admin"


class RefusedError(AdminError):
    """The action is not allowed on that item: a discarded DLQ record replayed, a DLQ record
    without a consumer-group header replayed; nothing was changed."""

    __module__ = "ledgerbox.admin"
