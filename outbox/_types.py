"""SQLAlchemy column types for PostgreSQL's ``xid8`` and ``pg_snapshot`` (PostgreSQL 13+).

The relay's read design stores transaction ids and snapshots (docs/relay.md, "Read
design"); SQLAlchemy has no types for them. Values travel as text (``'12345'``,
``'100:104:101,102'``); the relay's SQL casts them itself. Both are registered with the
PostgreSQL dialect's reflection, so Alembic's autogenerate compares them like any other type.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import base as pg_base

__all__ = ["PgSnapshot", "Xid8"]


class Xid8(sa.types.UserDefinedType[str]):
    """``xid8``: a 64-bit transaction id (epoch and xid, never wraps around)."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "XID8"


class PgSnapshot(sa.types.UserDefinedType[str]):
    """``pg_snapshot``: which transactions a snapshot sees (``xmin:xmax:xip_list``)."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "PG_SNAPSHOT"


# Reflection maps type names to types through this table (otherwise: NullType and a warning).
pg_base.ischema_names.setdefault("xid8", Xid8)
pg_base.ischema_names.setdefault("pg_snapshot", PgSnapshot)
