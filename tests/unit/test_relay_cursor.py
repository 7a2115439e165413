"""The cursor policy (``relay._cursor``): how claims and batch outcomes move a shard's cursor."""

from __future__ import annotations

from ledgerbox.relay._cursor import (
    CursorBook,
    ShardState,
    next_states,
    persisted_cursor,
    plan_reads,
    with_ids,
)
from ledgerbox.relay._store import Claim, ClaimedEvent, Cursor, ShardRead


def row(shard: int, row_id: int) -> ClaimedEvent:
    return ClaimedEvent(
        id=row_id,
        shard=shard,
        topic="t",
        partition_key="k",
        payload=b"{}",
        headers="{}",
        event_id="e",
        idempotency_key="i",
        event_type="E",
        source="/s",
        aggregate_type="a",
        aggregate_id="1",
        aggregate_version=None,
        occurred_at_ms=0,
        occurred_at_iso="1970-01-01T00:00:00+00:00",
    )


def closed(lo: str | None, fence: int = 1) -> ShardState:
    return ShardState(fence, Cursor(lo))


def test_a_claim_that_is_not_full_closes_every_range_it_read_at_its_snapshot() -> None:
    states = {1: closed(None), 2: closed("5:5:")}
    reads = plan_reads(list(states.items()), 10)
    assert reads == [ShardRead(1, Cursor(None)), ShardRead(2, Cursor("5:5:"))]
    claim = Claim([row(1, 3), row(1, 4)], "9:9:")
    after = next_states(states, reads, claim, 10)
    assert after == {1: closed("9:9:"), 2: closed("9:9:")}, "shard 2 read nothing: closed too"


def test_a_full_claim_keeps_the_range_of_shards_with_rows_open_and_leaves_the_others() -> None:
    states = {1: closed("5:5:"), 2: closed("5:5:"), 3: closed("6:6:")}
    reads = plan_reads(list(states.items()), 3)
    claim = Claim([row(1, 7), row(2, 3), row(2, 8)], "9:9:")
    after = next_states(states, reads, claim, 3)
    assert after[1].cursor == Cursor("5:5:", "9:9:", 7)
    assert after[2].cursor == Cursor("5:5:", "9:9:", 8)
    assert after[3] == states[3], "maybe not reached before the limit: unchanged"
    assert after[1].needs_ids and after[2].needs_ids


def test_an_open_range_is_read_by_pages_of_its_id_list_and_closes_when_used_up() -> None:
    state = ShardState(1, Cursor("5:5:", "9:9:", 7))
    assert plan_reads([(1, state)], 10) == [], "an open range waits for its id list"
    listed = with_ids(state, [8, 11, 12], cap=3)
    assert not listed.complete, "as many as the cap: more may follow"
    reads = plan_reads([(1, listed), (2, closed("6:6:"))], 2)
    assert reads == [ShardRead(1, listed.cursor, [8, 11]), ShardRead(2, Cursor("6:6:"))]
    # id 11 no longer in the range (replayed meanwhile): the page still moves past it
    after = next_states({1: listed, 2: closed("6:6:")}, reads, Claim([row(1, 8)], "10:10:"), 2)
    assert after[1].cursor == Cursor("5:5:", "9:9:", 11) and after[1].pos == 2
    assert after[2] == closed("6:6:"), "the pages filled the batch: not read"
    last = plan_reads([(1, after[1])], 5)
    assert last == [ShardRead(1, after[1].cursor, [12])]
    done = next_states({1: after[1]}, last, Claim([row(1, 12)], "10:10:"), 5)
    assert done[1].cursor == Cursor("5:5:", "9:9:", 12) and done[1].needs_ids, (
        "the list was capped: list again after 12"
    )
    complete = with_ids(done[1], [13], cap=3)
    assert complete.complete
    end = next_states({1: complete}, plan_reads([(1, complete)], 5), Claim([], "11:11:"), 5)
    assert end[1] == ShardState(1, Cursor("9:9:")), "range done: lo = its hi"
    assert with_ids(done[1], [], cap=3) == ShardState(1, Cursor("9:9:")), "empty: closed"


def test_shards_reported_ahead_of_the_database_are_left_out() -> None:
    states = {1: closed("99:99:"), 2: closed("5:5:")}
    reads = plan_reads(list(states.items()), 10)
    after = next_states(states, reads, Claim([], "9:9:", ahead=[1]), 10)
    assert list(after) == [2]


def test_a_failed_row_persists_the_shard_only_up_to_the_last_row_handled_before_it() -> None:
    before = closed("5:5:")
    after = closed("9:9:")
    all_ok = [(3, True), (4, True)]
    assert persisted_cursor(before, after, "9:9:", all_ok) == Cursor("9:9:")
    partial = [(3, True), (4, True), (6, False), (8, True)]
    assert persisted_cursor(before, after, "9:9:", partial) == Cursor("5:5:", "9:9:", 4)
    assert persisted_cursor(before, after, "9:9:", [(3, False), (4, True)]) is None
    # in an open range the cursor keeps its hi
    mid = ShardState(1, Cursor("5:5:", "9:9:", 2))
    assert persisted_cursor(mid, after, "9:9:", partial) == Cursor("5:5:", "9:9:", 4)


def test_the_book_forgets_states() -> None:
    book = CursorBook()
    book.states[1] = closed(None)
    book.states[2] = closed(None)
    book.forget([1, 7])
    assert list(book.states) == [2]
