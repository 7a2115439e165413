"""The payloads the example services exchange, checked where they are consumed.

A consumer trusts nothing in a record it did not write: another deployment, a hand-made
record, a producer of an older release. Each handler parses its event's payload into one of
these models first, before it reads or writes anything; a payload that does not fit raises
:class:`MalformedEventError`, which both example consumers declare in ``dead_letter_on``: the
event is dead-lettered on its first attempt (retrying cannot fix it) and nothing is written
for it. The dead-letter topic keeps the record for whoever owns the producer; replaying it
would fail the same way, so the remedy is a corrected event from the producer, then ``ledgerbox
consumer dlq discard`` (docs/operations.md).

The rules are the APIs' own (:data:`CustomerId`, :data:`Amount`, used by ``PlaceOrder`` in
``example_services/orders/api.py`` and the payment API too): an amount is a positive decimal
with at most 12 digits, 2 after the point (the ``Numeric(12, 2)`` columns of both services: a
third place would be rounded by the database while the event carried the unrounded amount),
a customer id 1-64 characters of letters, digits and ``_.:-``.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ledgerbox.outbox import EventEnvelope

__all__ = [
    "CUSTOMER_ID_PATTERN",
    "Amount",
    "CustomerId",
    "MalformedEventError",
    "OrderPlacedPayload",
    "PaymentResultPayload",
    "parse_payload",
]


#: What a customer id may hold: the order API's body, the payment API's path and the
#: ``OrderPlaced`` payload share it, so the consumer never refuses an order the API took.
CUSTOMER_ID_PATTERN = r"^[A-Za-z0-9_.:-]+$"

#: A customer id: 1-64 characters of :data:`CUSTOMER_ID_PATTERN`.
CustomerId = Annotated[str, Field(min_length=1, max_length=64, pattern=CUSTOMER_ID_PATTERN)]

#: A money amount: positive, at most 12 digits, 2 after the point (the ``Numeric(12, 2)``
#: columns), finite.
Amount = Annotated[Decimal, Field(gt=0, max_digits=12, decimal_places=2, allow_inf_nan=False)]


class MalformedEventError(ValueError):
    """An event's payload does not fit its contract (a fault of the event, never retried).

    The message is one line: the event type and id, then each offending field and why.
    """


class OrderPlacedPayload(BaseModel):
    """Payload of ``OrderPlaced`` (order service -> payment service). ``currency`` and
    fields added by later releases are ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    order_id: uuid.UUID
    customer_id: CustomerId
    amount: Amount


class PaymentResultPayload(BaseModel):
    """What the order service reads of ``PaymentSucceeded`` / ``PaymentFailed``: the order
    it settles (the event type says how)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    order_id: uuid.UUID


Payload = TypeVar("Payload", bound=BaseModel)


def parse_payload(model: type[Payload], event: EventEnvelope) -> Payload:
    """``event.payload`` as ``model``.

    Raises
    ------
    MalformedEventError
        A field is missing or invalid; the message names each (``amount: Input should be
        greater than 0``) and the event (``OrderPlaced 3f2c...``).
    """
    try:
        return model.model_validate(event.payload)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'payload'}: {error['msg']}"
            for error in exc.errors(include_url=False)
        )
        raise MalformedEventError(
            f"{event.event_type} {event.event_id}: payload invalid: {problems}"
            " (dead-lettered: the producer must send a corrected event)"
        ) from None
