"""Business tables of the payment service (created with ``metadata.create_all``)."""

from __future__ import annotations

import enum

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

__all__ = ["PaymentStatus", "metadata", "payments", "wallet_topups", "wallets"]


class PaymentStatus(enum.StrEnum):
    """Outcome of one order's payment."""

    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


metadata = sa.MetaData()

# The hot aggregate: every order of a customer debits this one row, guarded by ``version``.
wallets = sa.Table(
    "wallets",
    metadata,
    sa.Column("customer_id", sa.Text, primary_key=True),
    sa.Column("balance", sa.Numeric(14, 2), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column(
        "updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
)

wallet_topups = sa.Table(
    "wallet_topups",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
    sa.Column("idempotency_key", sa.Text, nullable=False, unique=True),
    sa.Column("customer_id", sa.Text, nullable=False),
    sa.Column("amount", sa.Numeric(12, 2), nullable=False),
    sa.Column("balance_after", sa.Numeric(14, 2), nullable=False),
    sa.Column(
        "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
    sa.CheckConstraint("amount > 0", name="ck_wallet_topups_amount_positive"),
)

payments = sa.Table(
    "payments",
    metadata,
    sa.Column("id", pg.UUID(as_uuid=True), primary_key=True),
    # At most one payment per order, whatever the consumer does (the checker also counts).
    sa.Column("order_id", pg.UUID(as_uuid=True), nullable=False, unique=True),
    sa.Column("customer_id", sa.Text, nullable=False),
    sa.Column("amount", sa.Numeric(12, 2), nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("reason", sa.Text, nullable=True),
    # Wallet balance right after this payment (unchanged for a failed one).
    sa.Column("balance_after", sa.Numeric(14, 2), nullable=True),
    sa.Column("event_id", pg.UUID(as_uuid=True), nullable=False),
    sa.Column(
        "created_at",
        sa.DateTime(timezone=True),
        nullable=False,
        server_default=sa.text("clock_timestamp()"),
    ),
    sa.CheckConstraint("status IN ('SUCCEEDED', 'FAILED')", name="ck_payments_status"),
    # The handler refuses such an amount first (MalformedEventError); this is the backstop.
    sa.CheckConstraint("amount > 0", name="ck_payments_amount_positive"),
)
