"""Business tables of the order service (created with ``metadata.create_all``)."""

from __future__ import annotations

import enum

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

__all__ = ["OrderStatus", "metadata", "order_events_applied", "orders"]


class OrderStatus(enum.StrEnum):
    """PENDING -> PAID or PENDING -> CANCELLED; nothing else is legal (see ``_handlers``)."""

    PENDING = "PENDING"
    PAID = "PAID"
    CANCELLED = "CANCELLED"


metadata = sa.MetaData()

orders = sa.Table(
    "orders",
    metadata,
    sa.Column("id", pg.UUID(as_uuid=True), primary_key=True),
    sa.Column("customer_id", sa.Text, nullable=False),
    sa.Column("amount", sa.Numeric(12, 2), nullable=False),
    sa.Column("currency", sa.String(3), nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column(
        "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
    # Stamped with the database clock inside the consumer's transaction: created_at ->
    # closed_at is the commit-to-applied latency across both services.
    sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('PENDING', 'PAID', 'CANCELLED')", name="ck_orders_status"),
    sa.CheckConstraint("amount > 0", name="ck_orders_amount_positive"),
    sa.Index("ix_orders_pending", "id", postgresql_where=sa.text("status = 'PENDING'")),
)

# One row per event the order aggregate saw, in the order it was applied (``id`` is assigned
# inside the applying transaction, and versions chain): the checker verifies the history.
order_events_applied = sa.Table(
    "order_events_applied",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
    sa.Column("order_id", pg.UUID(as_uuid=True), nullable=False),
    sa.Column("event_id", pg.UUID(as_uuid=True), nullable=False),
    sa.Column("event_type", sa.Text, nullable=False),
    sa.Column("from_status", sa.Text, nullable=True),
    sa.Column("to_status", sa.Text, nullable=False),
    sa.Column("version_before", sa.Integer, nullable=False),
    sa.Column("version_after", sa.Integer, nullable=False),
    sa.Column("outcome", sa.Text, nullable=False),  # "applied" or "ignored"
    sa.Column(
        "applied_at",
        sa.DateTime(timezone=True),
        nullable=False,
        server_default=sa.text("clock_timestamp()"),
    ),
    sa.UniqueConstraint("order_id", "event_id", name="uq_order_events_applied_event"),
    sa.Index("ix_order_events_applied_order", "order_id", "id"),
)
