"""HTTP API of the payment service (FastAPI).

- ``GET /payments/{order_id}``: the payment of an order (``404`` until the consumer made it).
- ``GET /wallets/{customer_id}``: balance and version (``404`` if the customer has none).
- ``POST /wallets/{customer_id}/top-up`` (header ``Idempotency-Key``, body ``{"amount"}``):
  credits the wallet, creating it at 0 first if missing. ``201`` new top-up; ``200`` retry of
  an already committed top-up (the first result, nothing written); ``400`` key missing or
  malformed; ``422`` invalid body or key reused with a different amount; ``503`` the
  database cannot be reached right now (retry with the same key).
- ``GET /health``, ``GET /metrics``.

Run: ``uvicorn --factory example_services.payments.api:create_app``.
"""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import FastAPI, Header, HTTPException, Path, Response
from pydantic import BaseModel, ConfigDict
from sqlalchemy.dialects.postgresql import insert as pg_insert

from example_services._config import ServiceSettings
from example_services._events import CUSTOMER_ID_PATTERN, Amount
from example_services._http import service_app, validate_idempotency_key
from example_services.payments._models import metadata, payments, wallet_topups, wallets
from ledgerbox.outbox import idempotency_key

__all__ = ["TopUp", "create_app"]

CustomerId = Annotated[str, Path(min_length=1, max_length=64, pattern=CUSTOMER_ID_PATTERN)]


class _Replay(Exception):
    """Rolls the transaction back when the Idempotency-Key was already used."""


class TopUp(BaseModel):
    """Body of ``POST /wallets/{customer_id}/top-up``."""

    model_config = ConfigDict(extra="forbid")

    amount: Amount


class TopUpOut(BaseModel):
    """A committed top-up."""

    customer_id: str
    amount: Decimal
    balance_after: Decimal
    created_at: dt.datetime


class WalletOut(BaseModel):
    """A wallet."""

    customer_id: str
    balance: Decimal
    version: int
    updated_at: dt.datetime


class PaymentOut(BaseModel):
    """The payment of one order."""

    id: uuid.UUID
    order_id: uuid.UUID
    customer_id: str
    amount: Decimal
    status: str
    reason: str | None
    balance_after: Decimal | None
    created_at: dt.datetime


def create_app(settings: ServiceSettings | None = None) -> FastAPI:
    """Build the app; the database is prepared (if enabled) and connected at startup."""
    cfg = settings or ServiceSettings()
    app, engine = service_app("payment-service", cfg.payment_db_url, metadata, cfg.migrate_on_start)

    @app.post(
        "/wallets/{customer_id}/top-up",
        status_code=201,
        response_model=TopUpOut,
        responses={
            200: {"description": "Retry of a committed top-up: the first result"},
            400: {"description": "Idempotency-Key missing or malformed"},
            422: {"description": "Invalid body, or the key was used for a different amount"},
        },
    )
    async def top_up(
        customer_id: CustomerId,
        body: TopUp,
        response: Response,
        key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
    ) -> dict[str, Any]:
        stored_key = idempotency_key("top-up", customer_id, validate_idempotency_key(key))
        try:
            async with engine().begin() as conn:
                # Credit first (row lock on the wallet, version bumped so that a consumer holding
                # an older version gets a conflict), then claim the key; a duplicate rolls back.
                balance_after = (
                    await conn.execute(
                        pg_insert(wallets)
                        .values(customer_id=customer_id, balance=body.amount, version=1)
                        .on_conflict_do_update(
                            index_elements=[wallets.c.customer_id],
                            set_={
                                "balance": wallets.c.balance + body.amount,
                                "version": wallets.c.version + 1,
                                "updated_at": sa.func.now(),
                            },
                        )
                        .returning(wallets.c.balance)
                    )
                ).scalar_one()
                inserted = (
                    (
                        await conn.execute(
                            pg_insert(wallet_topups)
                            .values(
                                idempotency_key=stored_key,
                                customer_id=customer_id,
                                amount=body.amount,
                                balance_after=balance_after,
                            )
                            .on_conflict_do_nothing(
                                index_elements=[wallet_topups.c.idempotency_key]
                            )
                            .returning(*wallet_topups.c)
                        )
                    )
                    .mappings()
                    .first()
                )
                if inserted is not None:
                    response.status_code = 201
                    return dict(inserted)
                # A committed top-up holds the key: undo this credit, answer with the first.
                raise _Replay
        except _Replay:
            pass
        async with engine().connect() as conn:
            first = (
                (
                    await conn.execute(
                        sa.select(wallet_topups).where(
                            wallet_topups.c.idempotency_key == stored_key
                        )
                    )
                )
                .mappings()
                .one()
            )
        if first["amount"] != body.amount:
            raise HTTPException(
                status_code=422, detail="Idempotency-Key was already used for a different amount"
            )
        response.status_code = 200
        return dict(first)

    @app.get("/wallets/{customer_id}", response_model=WalletOut)
    async def get_wallet(customer_id: CustomerId) -> dict[str, Any]:
        async with engine().connect() as conn:
            row = (
                (await conn.execute(sa.select(wallets).where(wallets.c.customer_id == customer_id)))
                .mappings()
                .first()
            )
        if row is None:
            raise HTTPException(status_code=404, detail=f"no wallet for customer {customer_id}")
        return dict(row)

    @app.get("/payments/{order_id}", response_model=PaymentOut)
    async def get_payment(order_id: uuid.UUID) -> dict[str, Any]:
        async with engine().connect() as conn:
            row = (
                (await conn.execute(sa.select(payments).where(payments.c.order_id == order_id)))
                .mappings()
                .first()
            )
        if row is None:
            raise HTTPException(status_code=404, detail=f"no payment for order {order_id}")
        return dict(row)

    return app
