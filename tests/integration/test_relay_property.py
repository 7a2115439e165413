"""A property over interleavings on real PostgreSQL: writers that commit, abort, stay open
across relay cycles, roll back a savepoint, or take their transaction id before they wait
for their key's lock, interleaved with claims of the relay (small batches, so ranges are
read in pages). Whatever the schedule: every committed event is published at least once,
nothing of an aborted writer or a rolled-back savepoint ever is, and for each key the
events come out in the order their (lock-serialized) writers committed.

Writers of one key serialize on the key's row lock (``SELECT ... FOR UPDATE``), as
services do; the schedule only lets a writer take the lock when it is free, so nothing
blocks the single-threaded test. A writer that took its id early (a write elsewhere first)
then waited for the lock commits after writers with later ids: transaction-id order is not
commit order, which a cursor must not confuse.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine, text

from ledgerbox.relay import Relay
from ledgerbox.relay.testing import InMemoryPublisher
from tests import _relay_support as rs

KEYS = 2


@dataclass
class _Writer:
    key: int
    end: str  # "commit" | "abort"
    early_xid: bool
    savepoint: bool
    events: int
    conn: Connection | None = None
    step: int = 0  # 0 new, 1 begun, 2 locked and wrote, 3 done
    ids: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


writers_strategy = st.lists(
    st.builds(
        _Writer,
        key=st.integers(0, KEYS - 1),
        end=st.sampled_from(["commit", "commit", "abort"]),
        early_xid=st.booleans(),
        savepoint=st.booleans(),
        events=st.integers(1, 3),
    ),
    min_size=1,
    max_size=6,
)
# ("w", i): advance writer i by one step (if it can); ("r",): one relay cycle.
schedule_strategy = st.lists(
    st.one_of(st.tuples(st.just("w"), st.integers(0, 5)), st.just(("r",))), max_size=40
)


class _World:
    def __init__(self, engine: Engine, topic: str, prefix: str) -> None:
        self.engine, self.topic, self.prefix = engine, topic, prefix
        self.writer = rs.writer_for(topic)
        self.committed: dict[int, list[str]] = {k: [] for k in range(KEYS)}  # commit order
        self.aborted: set[str] = set()
        self.holder: dict[int, _Writer] = {}

    def key(self, k: int) -> str:
        return f"{self.prefix}-{k}"

    def advance(self, w: _Writer) -> None:
        if w.step == 0:
            w.conn = self.engine.connect()
            w.conn.begin()
            if w.early_xid:
                w.conn.execute(text("INSERT INTO prop_scratch (note) VALUES ('early')"))
            w.step = 1
        elif w.step == 1:
            if w.key in self.holder:
                return  # the key's row lock is taken: this writer would wait
            assert w.conn is not None
            w.conn.execute(
                text("SELECT 1 FROM prop_keys WHERE key = :k FOR UPDATE"), {"k": self.key(w.key)}
            )
            self.holder[w.key] = w
            for n in range(w.events):
                if w.savepoint and n == 0:
                    nested = w.conn.begin_nested()
                    lost = self._event(w, n, dropped=True)
                    self.writer.stage(w.conn, lost)
                    nested.rollback()
                    w.dropped.append(str(lost.event_id))
                event = self._event(w, n)
                self.writer.stage(w.conn, event)
                w.ids.append(str(event.event_id))
            w.step = 2
        elif w.step == 2:
            assert w.conn is not None
            if w.end == "commit":
                w.conn.commit()
                self.committed[w.key] += w.ids
            else:
                w.conn.rollback()
                self.aborted.update(w.ids)
            self.aborted.update(w.dropped)
            w.conn.close()
            del self.holder[w.key]
            w.step = 3

    def _event(self, w: _Writer, n: int, dropped: bool = False) -> Any:
        payload = {"seq": n, "dropped": dropped}
        return rs.event(self.writer, self.key(w.key), n, payload=payload)

    def finish(self, writers: list[_Writer]) -> None:
        while any(w.step < 3 for w in writers):
            for w in writers:
                if w.step < 3:
                    self.advance(w)


@pytest.fixture(scope="module")
def prop_tables(engine: Engine) -> Engine:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE prop_keys (key text PRIMARY KEY)"))
        conn.execute(text("CREATE TABLE prop_scratch (id bigserial PRIMARY KEY, note text)"))
    return engine


@settings(
    max_examples=int(__import__("os").environ.get("LEDGERBOX_TEST_PROPERTY_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(writers=writers_strategy, schedule=schedule_strategy)
def test_every_committed_event_once_or_more_per_key_in_commit_order(
    prop_tables: Engine, database_url: str, writers: list[_Writer], schedule: list[Any]
) -> None:
    engine = prop_tables
    prefix = uuid.uuid4().hex[:8]
    topic = f"prop-{prefix}"
    world = _World(engine, topic, prefix)
    with engine.begin() as conn:
        for k in range(KEYS):
            conn.execute(text("INSERT INTO prop_keys VALUES (:k)"), {"k": world.key(k)})
    publisher = InMemoryPublisher()

    async def run() -> None:
        rs.reset_relay_tables(engine)
        relay = Relay(
            rs.config(database_url, "unused:9092", batch_size=2, lanes=1, claim_linger_ms=0),
            publisher=publisher,
        )
        try:
            for action in schedule:
                if action[0] == "r":
                    await relay.run_once()
                elif action[1] < len(writers):
                    world.advance(writers[action[1]])
            world.finish(writers)
            for _ in range(200):
                if not await relay.run_once() and rs.pending_count(engine) == 0:
                    break
        finally:
            await relay.aclose()
            for w in writers:
                if w.conn is not None and not w.conn.closed:
                    w.conn.close()

    asyncio.run(run())
    mine = [r for r in publisher.records if r.topic == topic]
    published = [rs.header(r, "ce_id") for r in mine]
    committed = {i for ids in world.committed.values() for i in ids}
    assert committed <= set(published), "every committed event at least once"
    assert not world.aborted & set(published), "nothing of an aborted writer or savepoint"
    assert all(not json.loads(r.value)["dropped"] for r in mine)
    for k in range(KEYS):
        firsts = list(
            dict.fromkeys(rs.header(r, "ce_id") for r in mine if r.key == world.key(k).encode())
        )
        assert firsts == world.committed[k], f"key {k}: Kafka order = commit order"
