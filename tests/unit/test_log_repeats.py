"""The daemons rate-limit the Kafka client's repeated log lines (soak finding: ~75 ERROR lines a
second per daemon while one broker is down)."""

from __future__ import annotations

import logging

from ledgerbox._core.settings import RepeatFilter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _record(name: str, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)


def test_one_line_of_a_kind_per_window_then_the_count_of_the_dropped_ones() -> None:
    clock = Clock()
    limit = RepeatFilter(window_s=30.0, clock=clock)
    template = "Unable connect to node with id %s: %s"
    passed = []
    for i in range(750):  # 10 s of reconnects every ~13 ms
        clock.now = i * 0.013
        record = _record("aiokafka.client", template, 1, "refused")
        if limit.filter(record):
            passed.append(record.getMessage())
    assert passed == ["Unable connect to node with id 1: refused"]
    clock.now = 31.0
    record = _record("aiokafka.client", template, 1, "refused")
    assert limit.filter(record)
    assert record.getMessage() == (
        "Unable connect to node with id 1: refused (749 similar lines in the last 30 s)"
    )


def test_other_loggers_and_other_kinds_always_pass() -> None:
    limit = RepeatFilter(clock=Clock())
    assert all(limit.filter(_record("ledgerbox.relay", "relay down: %s", "x")) for _ in range(5))
    assert limit.filter(_record("aiokafka.client", "first kind"))
    assert limit.filter(_record("aiokafka.client", "second kind"))
    assert not limit.filter(_record("aiokafka.client", "first kind"))
