"""Waiting until the pipeline is drained, and the counts the summary reports."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from example_services.demo._kafka import consumer_lag

__all__ = ["DrainState", "count", "pending_events", "wait_drained"]


def count(url: str, sql: str) -> int:
    """``SELECT count(*) ...`` on ``url`` (a fixed, parameterless query of this package)."""
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(sql)).scalar_one())
    finally:
        engine.dispose()


def pending_events(url: str) -> int:
    """Events of ``url``'s outbox the relay has not published yet, as ``ledgerbox relay
    status`` reports them (whether a row is published is decided by the relay's cursors,
    not by the row: docs/relay.md)."""
    out = subprocess.run(
        [sys.executable, "-m", "ledgerbox.relay", "status", "--database-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    first = out.splitlines()[0]
    assert first.startswith("pending: "), out
    return int(first.removeprefix("pending: "))


@dataclass
class DrainState:
    """Last observed state; ``drained`` when every number is 0."""

    pending_outbox: dict[str, int] = field(default_factory=dict)
    lag: dict[str, int] = field(default_factory=dict)
    pending_orders: int = -1
    waited_s: float = 0.0
    drained: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "drained": self.drained,
            "waited_s": round(self.waited_s, 1),
            "pending_outbox": self.pending_outbox,
            "consumer_lag": self.lag,
            "pending_orders": self.pending_orders,
        }


async def observe(
    bootstrap: str,
    databases: dict[str, str],
    groups: Sequence[tuple[str, Sequence[str]]],
    order_db_url: str,
) -> DrainState:
    state = DrainState()
    for name, url in databases.items():
        state.pending_outbox[name] = await asyncio.to_thread(pending_events, url)
    for group, topics in groups:
        state.lag[group] = await consumer_lag(bootstrap, group, topics)
    state.pending_orders = await asyncio.to_thread(
        count, order_db_url, "SELECT count(*) FROM orders WHERE status = 'PENDING'"
    )
    state.drained = (
        not any(state.pending_outbox.values())
        and not any(state.lag.values())
        and state.pending_orders == 0
    )
    return state


async def wait_drained(
    bootstrap: str,
    databases: dict[str, str],
    groups: Sequence[tuple[str, Sequence[str]]],
    order_db_url: str,
    *,
    timeout_s: float,
    poll_s: float = 1.0,
    stable_polls: int = 2,
) -> DrainState:
    """Poll until drained ``stable_polls`` times in a row, or until ``timeout_s`` seconds."""
    started = time.monotonic()
    in_a_row = 0
    while True:
        try:
            state = await observe(bootstrap, databases, groups, order_db_url)
        except Exception:  # a broker or DB hiccup during polling is retried until the deadline
            state = DrainState()
        state.waited_s = time.monotonic() - started
        in_a_row = in_a_row + 1 if state.drained else 0
        if in_a_row >= stable_polls or state.waited_s >= timeout_s:
            state.drained = in_a_row >= stable_polls
            return state
        await asyncio.sleep(poll_s)
