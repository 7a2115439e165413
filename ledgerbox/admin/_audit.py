"""The audit trail of operator actions (table ``ledgerbox_ops_audit``)."""

from __future__ import annotations

from ledgerbox.admin._types import AuditEntry, Database

__all__ = ["list_audit"]


async def list_audit(
    db: Database, *, limit: int = 50, action: str | None = None
) -> list[AuditEntry]:
    """The newest audit rows first."""
    raise NotImplementedError
