"""Pure tests of the outbox envelope, keys, routing, wire form and write-time validation."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import AwareDatetime, BaseModel, ValidationError
from sqlalchemy.orm import Session

from ledgerbox import ConfigurationError, LedgerboxError
from ledgerbox.inbox.testing import kafka_parts
from ledgerbox.outbox import (
    DEFAULT_MAX_FUTURE_S,
    EnvelopeParseError,
    EventEnvelope,
    EventValidationError,
    FutureEventTimeError,
    NaiveDatetimeError,
    NonFiniteNumberError,
    OutboxTable,
    OutboxWriter,
    PayloadTooLargeError,
    TopicRouter,
    UnroutedEventError,
    envelope_from_kafka,
    idempotency_key,
    kafka_headers,
    timestamp_ms,
)


class Payment(BaseModel):
    amount: Decimal
    order_id: uuid.UUID
    at: AwareDatetime


def _writer(**kw: object) -> OutboxWriter:
    return OutboxWriter(TopicRouter(default="orders.events"), source="/test", **kw)  # type: ignore[arg-type]


def test_errors_report_public_import_path() -> None:
    assert PayloadTooLargeError.__module__ == "ledgerbox.outbox"
    assert issubclass(NaiveDatetimeError, LedgerboxError)
    assert issubclass(NaiveDatetimeError, ValueError)


def test_idempotency_key_is_stable_and_rejects_unstable_parts() -> None:
    merchant = uuid.UUID("8d3c0c0e-8a55-4c1e-9d43-1d2b8c3f0a11")
    first = idempotency_key("payment", merchant, "req-17")
    assert first == idempotency_key("payment", merchant, "req-17")
    assert first.startswith("payment:")
    assert first != idempotency_key("payment", merchant, "req-18")
    # Part boundaries matter: ("ab", "c") is not ("a", "bc").
    assert idempotency_key("x", "ab", "c") != idempotency_key("x", "a", "bc")
    for bad in (1.5, dt.datetime.now(dt.UTC), True, ""):
        with pytest.raises(EventValidationError):
            idempotency_key("payment", bad)  # type: ignore[arg-type]
    with pytest.raises(EventValidationError):
        idempotency_key()


def test_event_id_derives_from_idempotency_key() -> None:
    writer = _writer()
    key = idempotency_key("order", 7, "k1")
    a = writer.event(
        event_type="OrderPlaced",
        aggregate_type="order",
        aggregate_id=7,
        payload={},
        idempotency_key=key,
    )
    b = writer.event(
        event_type="OrderPlaced",
        aggregate_type="order",
        aggregate_id=7,
        payload={},
        idempotency_key=key,
    )
    assert a.event_id == b.event_id
    assert a.partition_key == "7"


def test_naive_datetimes_are_rejected_with_their_path() -> None:
    writer = _writer()
    naive = dt.datetime(2026, 1, 1, 12, 0)
    with pytest.raises(NaiveDatetimeError) as info:
        writer.event(
            event_type="E", aggregate_type="a", aggregate_id=1,
            payload={"lines": [{"at": naive}]}, idempotency_key="k",
        )  # fmt: skip
    assert info.value.path == "payload.lines[0].at"
    with pytest.raises(NaiveDatetimeError):
        writer.event(
            event_type="E", aggregate_type="a", aggregate_id=1, payload={},
            idempotency_key="k", occurred_at=naive,
        )  # fmt: skip


def test_payload_too_large_is_rejected_before_anything_is_staged() -> None:
    writer = _writer(max_payload_bytes=1000)
    event = writer.event(
        event_type="E", aggregate_type="a", aggregate_id=1, payload={"x": "y" * 1000},
        idempotency_key="k",
    )  # fmt: skip
    session = Session()  # no bind: staging must not do I/O
    with pytest.raises(PayloadTooLargeError) as info:
        writer.stage(session, event)
    assert info.value.size_bytes > 1000 and info.value.max_bytes == 1000
    assert not session.new


def test_stage_only_adds_to_the_session() -> None:
    writer = _writer()
    session = Session()  # unbound: any flush or query would raise
    events = [
        writer.event(
            event_type="E",
            aggregate_type="a",
            aggregate_id=i,
            payload={"i": i},
            idempotency_key=f"k{i}",
        )
        for i in range(3)
    ]
    writer.stage_many(session, events)
    assert len(session.new) == 3


def test_topic_router() -> None:
    router = TopicRouter(
        by_event_type={"PaymentFailed": "payments.failures"},
        by_aggregate_type={"payment": "payments.events"},
    )
    assert router.route("PaymentFailed", "payment") == "payments.failures"
    assert router.route("PaymentSucceeded", "payment") == "payments.events"
    with pytest.raises(UnroutedEventError):
        router.route("OrderPlaced", "order")
    with pytest.raises(ConfigurationError):
        TopicRouter(default="bad topic!")
    with pytest.raises(ConfigurationError):  # before: "$" matched before the final newline
        TopicRouter(default="orders\n")


@pytest.mark.parametrize(
    "name",
    ["Outbox", "out-box", "1outbox", "x" * 64, "outbox;drop", "", "order", "user", "outbox\n"],
)
def test_table_names_must_be_sql_identifiers(name: str) -> None:
    with pytest.raises(ConfigurationError):
        OutboxTable(name)
    with pytest.raises(ConfigurationError):
        OutboxTable("outbox", schema=name)


def test_a_notify_channel_over_63_chars_is_refused() -> None:
    # Before: OutboxTable("o" * 30, schema="s" * 30) passed, the migration too, and every
    # INSERT then failed in the NOTIFY trigger with "channel name too long".
    with pytest.raises(ConfigurationError, match=r"notify channel .* 71 chars"):
        OutboxTable("o" * 30, schema="s" * 30)
    assert len(OutboxTable("o" * 26, schema="s" * 26).notify_channel) == 63


def test_typed_payload_round_trips_exactly_through_json() -> None:
    original = Payment(
        amount=Decimal("100.10"),
        order_id=uuid.uuid4(),
        at=dt.datetime(2026, 3, 1, 8, 30, 15, 123456, tzinfo=dt.timezone(dt.timedelta(hours=5))),
    )
    event = _writer().event(
        event_type="PaymentRequested", aggregate_type="payment", aggregate_id=1,
        payload=original, idempotency_key="k",
    )  # fmt: skip
    wire = json.loads(json.dumps(event.payload))
    back = event.model_copy(update={"payload": wire}).payload_as(Payment)
    assert back == original
    assert str(back.amount) == "100.10"
    assert back.at.utcoffset() == dt.timedelta(hours=5)


def test_kafka_record_parse_errors_are_typed() -> None:
    with pytest.raises(EnvelopeParseError):
        envelope_from_kafka("t", b"k", b"\xff", [])
    with pytest.raises(EnvelopeParseError):
        envelope_from_kafka("t", b"k", b"[1]", [])
    with pytest.raises(EnvelopeParseError, match="missing CloudEvents headers"):
        envelope_from_kafka("t", b"k", b"{}", [("ce_id", b"x")])


# Storable text: no NUL, no lone surrogate (refused by the envelope: test below).
_chars = st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))
_text = st.text(_chars, min_size=1, max_size=20)
_json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**53), 2**53), st.text(_chars, max_size=20),
    st.decimals(allow_nan=False, allow_infinity=False, places=2).map(str),
)  # fmt: skip
_json = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12,
)
_aware = st.datetimes(
    min_value=dt.datetime(1970, 1, 2), max_value=dt.datetime(9999, 1, 1), timezones=st.just(dt.UTC)
)


@given(
    key=_text,
    event_type=_text,
    aggregate_id=_text,
    version=st.none() | st.integers(0, 2**62),
    occurred_at=_aware,
    payload=st.dictionaries(_text, _json, max_size=5),
    extra=st.dictionaries(st.sampled_from(["traceparent", "tracestate", "x-tenant"]), _text),
)
def test_envelope_round_trips_through_json_and_kafka_form(
    key: str,
    event_type: str,
    aggregate_id: str,
    version: int | None,
    occurred_at: dt.datetime,
    payload: dict[str, object],
    extra: dict[str, str],
) -> None:
    envelope = EventEnvelope(
        event_id=uuid.uuid4(),
        idempotency_key=key,
        event_type=event_type,
        topic="orders.events",
        partition_key=aggregate_id,
        source="/svc",
        aggregate_type="order",
        aggregate_id=aggregate_id,
        aggregate_version=version,
        occurred_at=occurred_at,
        payload=payload,
        headers=extra,
    )
    assert EventEnvelope.model_validate_json(envelope.model_dump_json()) == envelope
    headers = kafka_headers(
        event_id=envelope.event_id,
        event_type=event_type,
        source="/svc",
        occurred_at=occurred_at,
        idempotency_key=key,
        aggregate_type="order",
        aggregate_id=aggregate_id,
        aggregate_version=version,
        extra=extra,
    )
    value = json.dumps(payload).encode()
    parsed = envelope_from_kafka("orders.events", aggregate_id.encode(), value, headers)
    assert parsed == envelope


@pytest.mark.parametrize(
    ("payload", "path"),
    [
        ({"amount": float("nan")}, "payload.amount"),
        ({"lines": [{"price": float("inf")}]}, "payload.lines[0].price"),
        ({"lines": [1.0, -float("inf")]}, "payload.lines[1]"),
        ({"total": Decimal("NaN")}, "payload.total"),
        ({"total": Decimal("-Infinity")}, "payload.total"),
    ],
)
def test_failsafe_07_nan_and_infinity_are_refused_at_write_with_their_json_path(
    payload: dict[str, object], path: str
) -> None:
    """Issue 12 line 7: NaN / Infinity used to pass ``writer.event()`` and fail later, at
    flush (PostgreSQL's jsonb has no such token), or turn into ``null`` inside a model."""
    with pytest.raises(NonFiniteNumberError) as info:
        _writer().event(
            event_type="E", aggregate_type="a", aggregate_id=1, payload=payload,
            idempotency_key="k",
        )  # fmt: skip
    assert info.value.path == path
    assert "\n" not in str(info.value) and path in str(info.value)


def test_failsafe_07_nan_inside_a_pydantic_model_is_refused_not_written_as_null() -> None:
    class Line(BaseModel):
        price: float

    class Order(BaseModel):
        lines: list[Line]

    with pytest.raises(NonFiniteNumberError) as info:
        _writer().event(
            event_type="E", aggregate_type="a", aggregate_id=1,
            payload=Order(lines=[Line(price=1.5), Line(price=float("nan"))]),
            idempotency_key="k",
        )  # fmt: skip
    assert info.value.path == "payload.lines[1].price"
    finite = _writer().event(
        event_type="E", aggregate_type="a", aggregate_id=1,
        payload=Order(lines=[Line(price=1.5)]), idempotency_key="k",
    )  # fmt: skip
    assert finite.payload == {"lines": [{"price": 1.5}]}


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


@given(
    st.datetimes(
        min_value=dt.datetime(1, 1, 1, 0, 0), max_value=dt.datetime(9999, 12, 31, 23, 59, 59)
    ),
    st.sampled_from([dt.UTC, dt.timezone(dt.timedelta(hours=5, minutes=30)), dt.timezone.min]),
    st.booleans(),
)
def test_failsafe_11_record_timestamp_is_exact_over_the_whole_datetime_range(
    naive: dt.datetime, tz: dt.tzinfo, whole_ms: bool
) -> None:
    """Issue 12 line 11: ``int(ts.timestamp() * 1000)`` published exact-millisecond times 1 ms
    early outside roughly 2004-2038. The record timestamp is the event time in whole ms,
    rounded toward the past, computed with integers."""
    if whole_ms:
        naive = naive.replace(microsecond=naive.microsecond // 1000 * 1000)
    try:
        moment = naive.replace(tzinfo=tz)
        moment.astimezone(dt.UTC)
    except OverflowError:
        return  # not representable in UTC at the ends of the range
    micros = (moment - _EPOCH) // dt.timedelta(microseconds=1)
    expected = micros // 1000  # floor: toward the past, also before 1970
    assert timestamp_ms(moment) == expected
    if whole_ms:
        assert timestamp_ms(moment) * 1000 == micros


def test_failsafe_11_exact_milliseconds_known_to_break_the_float_form() -> None:
    # Each of these came out 1 ms early with int(ts.timestamp() * 1000).
    for moment in (
        dt.datetime(1987, 5, 10, 10, 40, 21, 915000, tzinfo=dt.UTC),
        dt.datetime(2039, 1, 12, 23, 59, 4, 595000, tzinfo=dt.UTC),
        dt.datetime(2039, 6, 1, 12, 0, 0, 3000, tzinfo=dt.UTC),
        dt.datetime(1952, 9, 30, 2, 38, 27, 386000, tzinfo=dt.UTC),
    ):
        assert timestamp_ms(moment) == (moment - _EPOCH) // dt.timedelta(milliseconds=1)
        assert dt.datetime.fromtimestamp(timestamp_ms(moment) / 1000, dt.UTC) == moment


def test_failsafe_12_an_event_time_beyond_kafkas_future_limit_is_refused_at_write() -> None:
    """Issue 12 line 12: a record Kafka refuses for its timestamp (1 h ahead by default)
    must never be a committed event that cannot be published. The writer refuses an event
    time beyond ``max_future_s`` (default 50 min) with a typed error, before the commit."""
    now = dt.datetime.now(dt.UTC)
    writer = _writer()
    assert writer.max_future_s == DEFAULT_MAX_FUTURE_S == 3000.0
    with pytest.raises(FutureEventTimeError) as info:
        writer.event(
            event_type="E", aggregate_type="a", aggregate_id=1, payload={},
            idempotency_key="k", occurred_at=now + dt.timedelta(hours=2),
        )  # fmt: skip
    assert info.value.max_future_s == 3000.0 and "max_future_s" in str(info.value)
    soon = writer.event(
        event_type="E", aggregate_type="a", aggregate_id=1, payload={},
        idempotency_key="k", occurred_at=now + dt.timedelta(minutes=10),
    )  # fmt: skip
    assert soon.occurred_at == now + dt.timedelta(minutes=10)
    unbounded = _writer(max_future_s=None).event(
        event_type="E", aggregate_type="a", aggregate_id=1, payload={},
        idempotency_key="k", occurred_at=dt.datetime(2100, 1, 1, tzinfo=dt.UTC),
    )  # fmt: skip
    assert unbounded.occurred_at.year == 2100
    with pytest.raises(ConfigurationError):
        _writer(max_future_s=-1.0)


def test_the_writers_own_sql_is_used_with_psycopg_3_only() -> None:
    """psycopg2 shares psycopg's parameter style but not its adaptation of UUIDs: only a
    psycopg 3 connection (sync or async) gets the driver SQL, any other the Core statement."""
    from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg, PGDialectAsync_psycopg
    from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2

    from ledgerbox.outbox._writer import _psycopg

    assert _psycopg(PGDialect_psycopg()) and _psycopg(PGDialectAsync_psycopg())
    assert PGDialect_psycopg2.default_paramstyle == "pyformat"  # why the style is no test
    assert not _psycopg(PGDialect_psycopg2())


_BAD_TEXT = ["\x00", "a\x00b", "\ud800", "x\udfffy"]
_EVENT_ARGS: dict[str, Any] = {
    "event_type": "OrderPlaced",
    "aggregate_type": "order",
    "aggregate_id": "1",
    "payload": {"a": 1},
    "idempotency_key": "k",
}


@pytest.mark.parametrize("bad", _BAD_TEXT)
@pytest.mark.parametrize(
    "where",
    ["idempotency_key", "event_type", "aggregate_id", "header name", "header value",
     "payload key", "payload value", "nested payload value"],
)  # fmt: skip
def test_unstorable_text_anywhere_in_an_event_is_a_typed_error_at_event(
    where: str, bad: str
) -> None:
    """A NUL (PostgreSQL text and jsonb refuse it) or a lone surrogate (no UTF-8 form) failed
    the flush with a raw DataError / UnicodeEncodeError; now event() refuses it, one line."""
    writer = OutboxWriter(TopicRouter(default="orders.events"), source="/svc")
    args: dict[str, Any] = dict(_EVENT_ARGS)
    if where in ("idempotency_key", "event_type", "aggregate_id"):
        args[where] = bad
    elif where == "header name":
        args["headers"] = {bad: "v"}
    elif where == "header value":
        args["headers"] = {"x-tenant": bad}
    elif where == "payload key":
        args["payload"] = {bad: 1}
    elif where == "payload value":
        args["payload"] = {"a": bad}
    else:
        args["payload"] = {"a": [{"b": bad}]}
    with pytest.raises(EventValidationError, match=r"NUL character|surrogate|unicode string") as c:
        writer.event(**args)
    assert "\n" not in str(c.value)


@pytest.mark.parametrize("value", [b'{"a": "\\u0000"}', b'{"a": "\\ud800"}'])
def test_a_record_whose_json_decodes_to_unstorable_text_is_a_parse_error(value: bytes) -> None:
    # JSON escapes decode to a NUL or a lone surrogate: the inbox could not store its row.
    event = OutboxWriter(TopicRouter(default="t"), source="/svc").event(
        event_type="OrderPlaced",
        aggregate_type="order",
        aggregate_id="1",
        payload={},
        idempotency_key="k",
    )
    key, _, headers = kafka_parts(event)
    with pytest.raises(EnvelopeParseError, match=r"NUL character|lone surrogate"):
        envelope_from_kafka("t", key, value, headers)


def test_a_wrong_key_type_a_bad_explicit_topic_and_a_line_break_are_typed_one_line_errors() -> None:
    writer = OutboxWriter(TopicRouter(default="orders.events"), source="/svc")
    args: dict[str, Any] = dict(_EVENT_ARGS)
    with pytest.raises(EventValidationError, match="idempotency_key must be a str, got int"):
        writer.event(**{**args, "idempotency_key": 123})  # was a bare TypeError from uuid5
    with pytest.raises(EventValidationError, match="not a legal Kafka topic name"):
        writer.event(**args, topic="bad topic!")  # was accepted; the relay's send failed
    with pytest.raises(EventValidationError) as caught:
        writer.event(**{**args, "payload": {"line\nbreak": "\x00"}})
    assert "\n" not in str(caught.value) and "line\\nbreak" in str(caught.value)


_any_text = st.text(st.characters(codec=None), max_size=6) | st.sampled_from(["\x00", "\ud800"])
_any_json = st.recursive(
    st.none() | st.integers() | _any_text,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(_any_text, inner, max_size=4)
    ),
    max_leaves=10,
)


@given(value=_any_json)
def test_the_fast_storable_test_agrees_with_the_walk_that_names_the_place(value: object) -> None:
    from ledgerbox.outbox._envelope import _all_storable, _check_strings

    try:
        _check_strings(value, "payload")
        named = True
    except ValueError:
        named = False
    assert _all_storable(value) is named


def test_keys_that_become_one_json_key_are_refused_not_silently_merged() -> None:
    # Before: {1: "x", "1": "y"} became {"1": "y"}: one value dropped without a word (the JSON
    # form of the key 1 is "1"). Distinct non-string keys are still converted.
    writer = _writer()

    def event(payload: dict[str, Any]) -> Any:
        return writer.event(
            event_type="E", aggregate_type="a", aggregate_id=1, payload=payload, idempotency_key="k"
        )

    with pytest.raises(EventValidationError, match=r"payload\.lines: keys 1 and '1' are the same"):
        event({"lines": {1: "x", "1": "y"}})
    with pytest.raises(EventValidationError, match="same JSON key"):
        event({"m": {uuid.UUID(int=1): 1, "00000000-0000-0000-0000-000000000001": 2}})
    assert event({"lines": {1: "x", 2: "y"}}).payload == {"lines": {"1": "x", "2": "y"}}


def test_an_envelope_built_directly_refuses_a_nested_non_string_key() -> None:
    # json.dumps turned it into a string at staging, silently (two keys 1 and "1" into two
    # equal JSON keys, of which PostgreSQL's jsonb keeps the last).
    fields = dict(
        _writer().event(
            event_type="E", aggregate_type="a", aggregate_id=1, payload={}, idempotency_key="k"
        )
    )
    with pytest.raises(ValidationError, match=r"payload\.a key 1 is not a string"):
        EventEnvelope(**{**fields, "payload": {"a": {1: "x", "1": "y"}}})


@pytest.mark.parametrize("shape", ["deep_mapping", "deep_list", "circular"])
def test_event_refuses_a_payload_too_deep_or_containing_itself_with_a_typed_error(
    shape: str,
) -> None:
    """A payload nested 5,000 deep (or holding itself) given to ``event()`` raised a bare
    ``RecursionError`` from the payload walk (adversarial review, 2026-12-02): now
    ``EventValidationError`` naming the cause and the fix."""
    payload: dict[str, object] = {}
    if shape == "circular":
        payload["self"] = payload
    else:
        cursor: object = payload
        for _ in range(5000):
            child: dict[str, object] | list[object] = {} if shape == "deep_mapping" else []
            if isinstance(cursor, dict):
                cursor["a"] = child
            else:
                cursor.append(child)  # type: ignore[attr-defined]
            cursor = child
    with pytest.raises(EventValidationError, match=r"nested too deeply.*flatten it"):
        _writer().event(
            event_type="E", aggregate_type="a", aggregate_id=1, payload=payload,
            idempotency_key="k",
        )  # fmt: skip
