"""Where each shard is read from, and how a claim and a batch's outcome move it: a pure
policy (no I/O, no clock; unit-tested in ``tests/unit/test_relay_cursor.py``).

A shard's :class:`~ledgerbox.relay._store.Cursor` ``(lo, hi, after_id)`` names a range of
committed transactions (visible in ``hi``, not in ``lo``) and how far it is read in id order.
A lane keeps a :class:`ShardState` per shard it claims: the cursor of its NEXT claim (ahead
of the persisted one while a batch is in flight), and for a large open range the list of its
remaining ids (id-list paging: the range is sorted once, then read page by page by id,
instead of sorting the whole range again for every page).

Moves (docs/relay.md, "Read design"):

* a claim that returns fewer rows than it could closes the range of every shard it read
  (``lo = hi``, ``hi = None``, ``after_id = 0``): the next claim reads what committed since;
* a claim that comes back full keeps the range of each shard that returned rows open
  (``hi`` = the snapshot it read, ``after_id`` = its last id) and leaves the others as they
  were (the outer limit may have stopped before them);
* a page of an id list moves ``after_id`` to its last id; the range closes when a complete
  list is used up;
* after a batch, a shard is persisted only up to its last row handled in a row (confirmed,
  dead-lettered or held): a row whose send failed, and every later row of the shard, is read
  again (:func:`persisted_cursor`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from ledgerbox.relay._store import Claim, Cursor, ShardRead

__all__ = [
    "CursorBook",
    "ShardState",
    "next_states",
    "persisted_cursor",
    "plan_reads",
    "with_ids",
]


@dataclass(frozen=True, slots=True)
class ShardState:
    """A lane's reading position in one shard held under ``fence``.

    Attributes
    ----------
    fence : int
        The lease fence the state belongs to: a new fence means the cursor is read again.
    cursor : Cursor
        Where the next claim reads.
    ids : Sequence[int] | None
        Id-list paging of an OPEN range: the ids after ``cursor.after_id`` from ``pos`` on
        (never mutated; ``None``: not listed yet).
    pos : int
        First unread index of ``ids``.
    complete : bool
        ``ids`` reach the end of the range (else a further list follows the last id).
    """

    fence: int
    cursor: Cursor
    ids: Sequence[int] | None = None
    pos: int = 0
    complete: bool = False

    @property
    def needs_ids(self) -> bool:
        """An open range without a list of ids to read."""
        return self.cursor.hi is not None and (self.ids is None or self.pos >= len(self.ids))


def with_ids(state: ShardState, ids: Sequence[int], cap: int) -> ShardState:
    """``state`` with a fresh id list (``cap``: the most the store returns; fewer means the
    list reaches the end of the range). An empty complete list closes the range."""
    complete = len(ids) < cap
    if not ids and complete:
        assert state.cursor.hi is not None
        return ShardState(state.fence, Cursor(lo=state.cursor.hi))
    return replace(state, ids=ids, pos=0, complete=complete)


def plan_reads(states: Sequence[tuple[int, ShardState]], limit: int) -> list[ShardRead]:
    """The reads of one claim of at most ``limit`` rows over ``states`` (rotation order):
    pages of the open ranges' id lists while there is room, and every closed range (the
    store reads those up to the room left, in the given order).

    Open ranges without a list are skipped (list them first: :func:`with_ids`).
    """
    reads: list[ShardRead] = []
    room = limit
    for shard, state in states:
        if state.cursor.hi is None:
            reads.append(ShardRead(shard, state.cursor))
        elif room > 0 and state.ids is not None and state.pos < len(state.ids):
            page = state.ids[state.pos : state.pos + room]
            room -= len(page)
            reads.append(ShardRead(shard, state.cursor, page))
    return reads


def next_states(
    states: Mapping[int, ShardState], reads: Sequence[ShardRead], claim: Claim, limit: int
) -> dict[int, ShardState]:
    """The state of every shard ``reads`` read once ``claim`` (of at most ``limit`` rows)
    returned (shards the claim reports ahead of the database are left out).

    Raises
    ------
    KeyError
        A read names a shard without a state.
    """
    last_id: dict[int, int] = {}
    for event in claim.events:
        last_id[event.shard] = event.id  # events are sorted by (shard, id)
    page_rows = sum(len(r.ids) for r in reads if r.ids is not None)
    ranges = {r.shard for r in reads if r.ids is None}
    range_rows = sum(1 for e in claim.events if e.shard in ranges)
    range_closed = range_rows < limit - page_rows
    ahead = set(claim.ahead)
    out: dict[int, ShardState] = {}
    # Closed ranges close at the claim's snapshot: one cursor object for all of them.
    at_snapshot = Cursor(lo=claim.snapshot)
    for read in reads:
        if read.shard in ahead:
            continue
        state = states[read.shard]
        cursor = read.cursor
        if read.ids is not None:
            out[read.shard] = _after_page(state, read.ids)
            continue
        hi = cursor.hi or claim.snapshot
        if range_closed:
            out[read.shard] = ShardState(
                state.fence, at_snapshot if cursor.hi is None else Cursor(lo=hi)
            )
        elif read.shard in last_id:
            out[read.shard] = ShardState(state.fence, Cursor(cursor.lo, hi, last_id[read.shard]))
        else:
            out[read.shard] = state
    return out


def persisted_cursor(
    before: ShardState, after: ShardState, hi: str, rows: Iterable[tuple[int, bool]]
) -> Cursor | None:
    """The cursor to persist for a shard after a batch: ``after.cursor`` if every row of
    the shard was handled, else the range read up to the last row handled before the first
    one that was not (``None``: not even the first, nothing to persist).

    Parameters
    ----------
    before, after : ShardState
        The shard's state before and after the claim of the batch.
    hi : str
        The snapshot the claim read the shard's range up to.
    rows : Iterable[tuple[int, bool]]
        ``(id, handled)`` of the shard's rows in id order.
    """
    last_handled: int | None = None
    for row_id, handled in rows:
        if not handled:
            if last_handled is None:
                return None
            return Cursor(before.cursor.lo, hi, last_handled)
        last_handled = row_id
    return after.cursor


def _after_page(state: ShardState, page: Sequence[int]) -> ShardState:
    cursor = state.cursor
    assert cursor.hi is not None and state.ids is not None
    pos = state.pos + len(page)
    moved = replace(cursor, after_id=page[-1]) if page else cursor
    if pos < len(state.ids):
        return replace(state, cursor=moved, pos=pos)
    if state.complete:
        return ShardState(state.fence, Cursor(lo=cursor.hi))
    return ShardState(state.fence, moved)


class CursorBook:
    """The reading positions of the shards a relay holds, shared by its lanes: a shard is
    read by one lane at a time and moves to another lane only between batches, so a lane
    reads and writes only the entries of its own shards.

    Attributes
    ----------
    states : dict[int, ShardState]
        Shard -> the state of its next claim.
    refused : dict[int, tuple[int, str]]
        Shard -> ``(fence, reason)``: refused under that fence (not read; a new fence reads
        the lease row again, where the refusal is recorded).
    """

    def __init__(self) -> None:
        self.states: dict[int, ShardState] = {}
        self.refused: dict[int, tuple[int, str]] = {}

    def forget(self, shards: Iterable[int]) -> None:
        """Drop the states of ``shards``: their next claim reads the lease rows again."""
        for shard in shards:
            self.states.pop(shard, None)
