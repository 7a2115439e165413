"""The relay's held/dead gauges and lease-change counter move, on real PostgreSQL
(docs/observability.md)."""

from __future__ import annotations

from typing import Any

from aiokafka.errors import MessageSizeTooLargeError
from sqlalchemy import Engine

from ledgerbox.relay import Relay
from ledgerbox.relay._metrics import DEAD_LETTERED_EVENTS, HELD_EVENTS, LEASE_CHANGES
from ledgerbox.relay.testing import InMemoryPublisher
from tests import _relay_support as rs


def _changes(change: str) -> float:
    return float(LEASE_CHANGES.labels(change=change)._value.get())


def _gauge(gauge: Any) -> float:
    return float(gauge._value.get())


async def test_dead_and_held_gauges_and_lease_changes(engine: Engine, database_url: str) -> None:
    rs.reset_relay_tables(engine)
    writer = rs.writer_for("metrics-hold")
    rs.stage(engine, writer, [rs.event(writer, "K", 1, payload={"seq": 1, "bad": True})])
    rs.stage(engine, writer, [rs.event(writer, "K", 2), rs.event(writer, "K", 3)])
    rs.stage(engine, writer, [rs.event(writer, "other", 1)])
    publisher = InMemoryPublisher()
    publisher.reject_on_send(lambda r: b'"bad"' in r.value, MessageSizeTooLargeError())
    relay = Relay(rs.config(database_url, "unused:9092", lanes=1), publisher=publisher)
    before = {c: _changes(c) for c in ("acquired", "leader", "released", "lost")}
    try:
        await relay.run_once()
        await relay.run_once()
        assert _changes("acquired") == before["acquired"] + 64
        assert _changes("leader") == before["leader"] + 1
        await relay._maintenance._round()  # the leader's counting round (test: at once)
        assert _gauge(DEAD_LETTERED_EVENTS) == 1
        assert _gauge(HELD_EVENTS) == 2
    finally:
        await relay.aclose()
    assert _changes("released") == before["released"] + 64
    assert _changes("lost") == before["lost"]


async def test_stray_gauge_and_one_error_line_for_events_outside_the_relays_shards(
    engine: Engine, database_url: str, caplog: Any
) -> None:
    """Events in shards no relay claims (writers with a larger shard_count): the leader's
    round sets ``ledgerbox_relay_stray_events`` and logs the cause once, not every round."""
    import logging

    from ledgerbox.relay._metrics import STRAY_EVENTS

    rs.reset_relay_tables(engine)
    stray = rs.stage_stray(engine, 20)
    relay = Relay(rs.config(database_url, "unused:9092", lanes=1), publisher=InMemoryPublisher())
    caplog.set_level(logging.ERROR, logger="ledgerbox.relay")
    try:
        await relay.run_once()
        await relay.run_once()
        await relay._maintenance._round()
        await relay._maintenance._round()
        assert _gauge(STRAY_EVENTS) == stray > 0
    finally:
        await relay.aclose()
    lines = [r.getMessage() for r in caplog.records if "shards outside 0-63" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"{stray} events wait"), lines
