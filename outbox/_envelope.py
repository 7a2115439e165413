"""The event envelope (a frozen pydantic model) and its JSON codec.

Payloads are stored as JSON; values that JSON cannot hold exactly are written as strings by
pydantic's JSON mode (``Decimal('100.10') -> "100.10"``, UUID, ISO 8601 datetimes with their
offset and microseconds), so a typed payload model reads them back exactly
(:meth:`EventEnvelope.payload_as`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import uuid
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Self, TypeVar

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import to_jsonable_python

from ledgerbox.outbox._errors import (
    EventValidationError,
    NaiveDatetimeError,
    NonFiniteNumberError,
)

__all__ = ["EventEnvelope", "dumps_payload", "idempotency_key", "to_json_payload"]

M = TypeVar("M", bound=BaseModel)

_KEY_NAMESPACE = uuid.UUID("6f1f2d9e-3b1c-4f51-9a57-2c9c1d0f4b11")


class EventEnvelope(BaseModel):
    """One domain event as written to the outbox and carried on Kafka.

    Every string (fields, header names and values, payload keys and values) must be storable
    in PostgreSQL and encodable as UTF-8: no NUL character and no lone surrogate
    (``ValidationError`` otherwise; :meth:`OutboxWriter.event` raises ``EventValidationError``).

    Attributes
    ----------
    event_id : uuid.UUID
        Unique id of this event (CloudEvents ``id``). Consumers deduplicate on it.
    idempotency_key : str
        Stable key from the business identity (see :func:`idempotency_key`): the same business
        request always yields the same key, so a retried request writes no second event.
    event_type : str
        E.g. ``"OrderPlaced"`` (CloudEvents ``type``).
    topic : str
        Kafka topic the relay publishes to.
    partition_key : str
        Kafka record key; events of one key keep their commit order. Normally the aggregate id.
    source : str
        CloudEvents ``source``, e.g. ``"/order-service"``.
    aggregate_type, aggregate_id : str
        The aggregate the event belongs to.
    aggregate_version : int | None
        Version of the aggregate after the change, or ``None`` when not versioned.
    occurred_at : datetime
        Timezone-aware event time; naive datetimes are rejected.
    payload : dict
        JSON-ready payload (only str, int, float, bool, None, list, dict).
    headers : dict[str, str]
        Extra headers (e.g. W3C ``traceparent``), carried as Kafka headers.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: uuid.UUID
    idempotency_key: str = Field(min_length=1, max_length=1024)
    event_type: str = Field(min_length=1, max_length=255)
    topic: str = Field(min_length=1, max_length=249)
    partition_key: str = Field(min_length=1, max_length=1024)
    source: str = Field(min_length=1, max_length=1024)
    aggregate_type: str = Field(min_length=1, max_length=255)
    aggregate_id: str = Field(min_length=1, max_length=1024)
    aggregate_version: int | None = None
    occurred_at: AwareDatetime
    payload: dict[str, Any]
    headers: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _storable_text(self) -> EventEnvelope:
        # Every string must be storable in PostgreSQL text/jsonb and sendable as UTF-8: a NUL
        # (text refuses 0x00, jsonb the escape \u0000) or a lone surrogate (no UTF-8 form;
        # json.loads makes one of "\ud800") failed the flush with a raw DataError or
        # UnicodeEncodeError, and an inbox row of such a record could not be written.
        fields = [getattr(self, name) for name in _TEXT_FIELDS]
        everything = "".join((*fields, *self.headers, *self.headers.values()))
        if "\x00" in everything or not everything.isascii():  # else: all storable (fast path)
            for name, value in zip(_TEXT_FIELDS, fields, strict=True):
                check_text(value, name)
            for key, value in self.headers.items():
                check_text(key, "headers")
                check_text(value, f"headers.{key}")
        if not _all_storable(self.payload):
            _check_strings(self.payload, "payload")  # raises, naming where
        return self

    @classmethod
    def model_construct(  # type: ignore[override]  # the plugin types it per field
        cls, _fields_set: set[str] | None = None, **values: Any
    ) -> Self:
        """Validated like the constructor: an envelope goes into the outbox and onto Kafka,
        so none is built from unchecked data (pydantic's ``model_construct`` skips every
        validator: a NUL, an empty partition key or a naive ``occurred_at`` reached the
        flush). ``_fields_set`` is ignored.

        Raises
        ------
        pydantic.ValidationError
            If a field is invalid (as the constructor).
        """
        return cls.model_validate(values)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; with ``update``, validated like a new envelope (pydantic's own
        ``model_copy`` does not validate ``update``: an empty partition key or a naive
        ``occurred_at`` passed into the outbox).

        Raises
        ------
        pydantic.ValidationError
            If an updated field is invalid (as the constructor).
        """
        if not update:
            return super().model_copy(deep=deep)
        return self.model_validate({**dict(self), **update})

    def copy(
        self,
        *,
        include: Any = None,
        exclude: Any = None,
        update: dict[str, Any] | None = None,
        deep: bool = False,
    ) -> Self:
        """pydantic's deprecated ``copy``, validated like :meth:`model_copy` (pydantic's own
        sets ``update`` and drops the ``exclude`` fields unchecked: an empty partition key, a
        naive ``occurred_at`` or a NUL reached the outbox). Use :meth:`model_copy`.

        Raises
        ------
        pydantic.ValidationError
            If the copy is not a valid envelope (as the constructor).
        """
        copied = super().copy(include=include, exclude=exclude, deep=deep)
        if update is None and include is None and exclude is None:
            return copied
        return self.model_validate({**dict(copied), **(update or {})})

    def payload_as(self, model: type[M]) -> M:
        """Validate the payload into ``model`` (e.g. restores ``Decimal`` and ``UUID`` exactly).

        Raises
        ------
        EventValidationError
            If the payload does not fit ``model``.
        """
        try:
            return model.model_validate(self.payload)
        except ValidationError as exc:
            raise EventValidationError(
                f"payload of {self.event_type} does not fit {model.__name__}: {exc}"
            ) from exc


def idempotency_key(*parts: str | int | uuid.UUID | Decimal) -> str:
    """Derive a stable idempotency key from the business identity of a request.

    Example: ``idempotency_key("payment", merchant_id, client_request_id)``.
    The key is a name-based UUID (RFC 4122 version 5) over the parts, so it is the same on
    every retry and on every machine. Never pass attempt counters, clocks or random values:
    they make each retry a new event.

    Raises
    ------
    EventValidationError
        If no part is given, a part is empty, or a part is a float, datetime or bool (values
        whose text form is not a stable identity).
    """
    if not parts:
        raise EventValidationError("idempotency_key() needs at least one part")
    texts: list[str] = []
    for part in parts:
        if isinstance(part, bool | float | dt.datetime | dt.date) or not isinstance(
            part, str | int | uuid.UUID | Decimal
        ):
            raise EventValidationError(
                f"idempotency key part {part!r} ({type(part).__name__}) is not a stable identity"
            )
        text = str(part)
        if not text:
            raise EventValidationError("idempotency key parts must not be empty")
        texts.append(f"{len(text)}:{text}")
    digest = hashlib.sha256("|".join(texts).encode()).hexdigest()
    return f"{texts[0].split(':', 1)[1]}:{uuid.uuid5(_KEY_NAMESPACE, digest)}"


_TEXT_FIELDS = (
    "idempotency_key",
    "event_type",
    "topic",
    "aggregate_type",
    "aggregate_id",
    "partition_key",
    "source",
)


def _storable(text: str) -> bool:
    """No NUL and no lone surrogate in ``text`` (see :func:`check_text`)."""
    if "\x00" in text:
        return False
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_text(value: str, path: str) -> None:
    """Raise ``ValueError`` if ``value`` holds a NUL or a lone surrogate (PostgreSQL's text
    and jsonb refuse the first, UTF-8 has no form for the second); ``path`` names where."""
    if _storable(value):
        return
    if "\x00" in value:
        raise ValueError(f"{path} contains a NUL character (PostgreSQL text cannot store it)")
    at = next(i for i, ch in enumerate(value) if "\ud800" <= ch <= "\udfff")
    raise ValueError(
        f"{path} contains a lone surrogate {value[at]!r} at {at} (not encodable as UTF-8)"
    )


def _all_storable(value: Any) -> bool:
    """Every string of a JSON-ready value (keys included) passes :func:`check_text`: the
    fast test, one loop over an explicit stack, no path built (a third of the recursive
    walk's time on a payload of 100 nested items). A container met again (shared, or one
    that contains itself) is not walked again: a circular payload used to loop forever here,
    in the constructor; ``json.dumps`` refuses it at staging (:func:`dumps_payload`)."""
    stack = [value]
    pop, push = stack.pop, stack.append
    seen: set[int] = set()
    while stack:
        node = pop()
        if isinstance(node, dict | list | tuple):
            if id(node) in seen:
                continue
            seen.add(id(node))
        if isinstance(node, dict):
            for key, item in node.items():
                if not isinstance(key, str) or not _storable(key):
                    return False
                if isinstance(item, str):
                    if "\x00" in item or (not item.isascii() and not _storable(item)):
                        return False
                elif isinstance(item, dict | list | tuple):
                    push(item)
        elif isinstance(node, list | tuple):
            for item in node:
                if isinstance(item, str):
                    if "\x00" in item or (not item.isascii() and not _storable(item)):
                        return False
                elif isinstance(item, dict | list | tuple):
                    push(item)
        elif isinstance(node, str) and not _storable(node):
            return False
    return True


def _check_strings(value: Any, path: str, seen: set[int] | None = None) -> None:
    """:func:`check_text` every string of a JSON-ready value (object keys included), naming
    the path of the first that fails (run once :func:`_all_storable` found one); each
    container once (``seen``: their ids), as there."""
    if isinstance(value, str):
        check_text(value, path)
        return
    if not isinstance(value, dict | list | tuple):
        return
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):  # json.dumps would make it one, silently
                raise ValueError(
                    f"{path} key {key!r} is not a string (JSON object keys are): build the "
                    "event with OutboxWriter.event(), which converts keys"
                )
            check_text(key, f"{path} key {key!r}")
            _check_strings(item, f"{path}.{key}", seen)
    else:
        for index, item in enumerate(value):
            _check_strings(item, f"{path}[{index}]", seen)


def one_line(exc: ValidationError) -> str:
    """pydantic's errors as one line: ``field: message; ...`` (its own text spans lines)."""
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    # A payload key or header name in the path may hold a line break: one line still.
    return "; ".join(parts).replace("\r", "\\r").replace("\n", "\\n")


def _check_values(value: Any, path: str) -> None:
    """Raise for values JSON (and PostgreSQL's ``jsonb``) cannot carry exactly: naive
    datetimes (their instant is unknown) and NaN / +-Infinity (no JSON form: pydantic would
    silently write ``null`` for a model field, PostgreSQL refuses the token at flush)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NonFiniteNumberError(path, value)
    elif isinstance(value, Decimal):
        if not value.is_finite():
            raise NonFiniteNumberError(path, value)
    elif isinstance(value, dt.datetime):
        if value.tzinfo is None or value.tzinfo.utcoffset(value) is None:
            raise NaiveDatetimeError(path)
    elif isinstance(value, Mapping):
        if not all(type(key) is str for key in value):
            _check_keys(value, path)
        for key, item in value.items():
            _check_values(item, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_values(item, f"{path}[{index}]")
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            _check_values(getattr(value, name), f"{path}.{name}")


def _check_keys(value: Mapping[Any, Any], path: str) -> None:
    """Raise if two keys of ``value`` become one JSON key (``1`` and ``"1"``): the JSON form
    kept one of the two values and dropped the other without a word."""
    seen: dict[str, Any] = {}
    for key in value:
        try:
            text = key if isinstance(key, str) else to_jsonable_python({key: None})
        except Exception:  # not a key JSON can carry: to_jsonable_python says so later
            continue
        text = text if isinstance(text, str) else next(iter(text))
        if text in seen:
            raise EventValidationError(
                f"{path}: keys {seen[text]!r} and {key!r} are the same JSON key {text!r} "
                "(one value would be lost): use distinct string keys"
            )
        seen[text] = key


def to_json_payload(payload: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    """Turn a pydantic model or a mapping into a JSON-ready dict.

    Raises
    ------
    NaiveDatetimeError
        If any datetime in the payload has no timezone.
    NonFiniteNumberError
        If any number in the payload is NaN or +-Infinity (``path`` says where).
    EventValidationError
        If the payload is not a model or mapping, holds a value JSON cannot carry, contains
        itself or is nested deeper than the interpreter's recursion limit (about 1,000).
    """
    try:
        _check_values(payload, "payload")
    except RecursionError:  # past the interpreter's limit, or a container holding itself
        raise _too_deep() from None
    if isinstance(payload, BaseModel):
        result = payload.model_dump(mode="json")
    elif isinstance(payload, Mapping):
        try:
            result = to_jsonable_python(dict(payload))
        except Exception as exc:  # pydantic_core raises a bare PydanticSerializationError
            raise EventValidationError(f"payload is not JSON-serializable: {exc}") from exc
    else:
        raise EventValidationError(
            f"payload must be a pydantic model or a mapping, got {type(payload).__name__}"
        )
    if not isinstance(result, dict) or not all(isinstance(k, str) for k in result):
        raise EventValidationError("payload must serialize to a JSON object with string keys")
    return result


def dumps_payload(payload: Mapping[str, Any]) -> bytes:
    """Compact UTF-8 JSON of a JSON-ready payload (the bytes the size limit applies to).

    Raises
    ------
    EventValidationError
        If the payload is not JSON-ready (a ``Decimal``, a ``datetime``, NaN or +-Infinity,
        a container that contains itself, or nested too deeply for ``json.dumps``):
        an envelope built directly, not by :meth:`OutboxWriter.event` (which converts the
        payload with :func:`to_json_payload`). Before, ``TypeError`` from ``json.dumps``, or
        PostgreSQL's ``DataError`` for a NaN at the flush.
    """
    try:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise EventValidationError(
            f"payload is not JSON-ready ({exc}): build events with OutboxWriter.event(), "
            "which converts it"
        ) from None
    except RecursionError:  # json.dumps past the interpreter's limit: it escaped stage as is
        raise _too_deep() from None
    return text.encode("utf-8")


def _too_deep() -> EventValidationError:
    return EventValidationError(
        "payload is nested too deeply to be encoded as JSON (or contains itself): flatten it"
    )
