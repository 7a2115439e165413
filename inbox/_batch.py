"""Several records in one transaction.

Runs of up to ``batch_max_records`` parseable records whose handlers are of one kind (async
or sync) are applied in ONE transaction: one inbox insert for all of them, the handlers of the
newly inserted events in order, one commit (events whose row is DEAD_LETTERED are
acknowledged without their handler, C17). Any error rolls the whole run back and its
records go through the per-message path (:mod:`inbox._message`) one by one, with its retries
and dead-lettering, so the guarantees are those of one message.

The records may come from several partitions (the runner lends the records waiting on idle
partitions to the batch a worker starts: docs/inbox.md, "Across partitions"), each partition's in
offset order; the caller says so with ``own``. Such a batch never enters the per-message
path: the first record that would (its run rolled back, or it cannot share a transaction)
ends the batch as ``Outcome.ABANDONED``, it and every record after it given back to their
partitions' workers, which then run them each on its own. So a record that fails or
retries holds up no other partition, and the per-message path sees one partition's records.
(A lone event with a handler still goes through a transaction of its own here; what cannot
share one at all - a record that does not parse, an event type without a handler, an
operator's replay - ends the batch.) ``own`` is the partition of the worker running the
batch; only whether it is given matters here.

Redis on this path (:mod:`inbox._hints`): a run reads the "done" hints only where a duplicate
is likely (:class:`inbox._hints.HintPolicy`), and the hints of a committed run are written
in the background, after the commit, while the next run goes on.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ledgerbox.inbox._context import HandlerContext
from ledgerbox.inbox._deadletter import replay_target
from ledgerbox.inbox._deps import PipelineDeps
from ledgerbox.inbox._handlers import Registered
from ledgerbox.inbox._message import MessagePipeline
from ledgerbox.inbox._policy import Outcome, delivery_outcome
from ledgerbox.inbox._record import Parsed, Record, parse_record, record_timestamp_ms
from ledgerbox.inbox._spans import consumer_span
from ledgerbox.outbox import EventEnvelope

__all__ = ["BatchPipeline"]

_log = logging.getLogger("ledgerbox.inbox")
DEAD = Outcome.ALREADY_DEAD_LETTERED
#: Outcomes that say the event had been seen before (the hint policy's "duplicate").
_SEEN = frozenset({Outcome.DUPLICATE, Outcome.ALREADY_DEAD_LETTERED})


class BatchPipeline:
    """The batched path of one consumer.

    Parameters
    ----------
    deps : PipelineDeps
        The consumer's dependencies.
    messages : MessagePipeline
        The per-message path, for the records that cannot share a transaction and for the
        runs that rolled back.
    """

    def __init__(self, deps: PipelineDeps, messages: MessagePipeline) -> None:
        self.deps = deps
        self.messages = messages
        self.metrics = deps.metrics

    async def process(
        self,
        records: Sequence[Record],
        abandon: Callable[[], bool],
        own: tuple[str, int] | None = None,
    ) -> list[Outcome]:
        """Run the pipeline for records in order (each partition's consecutive, in offset
        order; several partitions only with ``own``).

        ``own``: (topic, partition) of the worker running a batch that holds records of
        other partitions too: the first record not applied in a committed run ends it
        (module docstring). ``None``: the records of one partition, with the per-message
        path for those that need it.

        Returns one outcome per record, in order; it stops after the first ``ABANDONED``.
        """
        # Each record is parsed once, here; the per-message path reuses the result.
        parsed = [parse_record(record) for record in records]
        outcomes: list[Outcome] = []
        i = 0
        while i < len(records):
            if abandon():  # revoked or stopping: the rest is the next owner's
                outcomes.append(Outcome.ABANDONED)
                return outcomes
            j, registered = self._batchable_run(parsed, i, records)
            run: list[Outcome] | None = None
            # A lone event runs alone on the per-message path, except in a batch holding
            # other partitions' records: that one never enters it (module docstring).
            if registered is not None and (j - i >= 2 or own is not None):
                events = [p for p in parsed[i:j] if isinstance(p, EventEnvelope)]
                run = await self._apply(records[i:j], events, registered, own is not None)
            if run is not None:
                outcomes.extend(run)
                self._observe(records[i:j], run)
                i = j
                continue
            if own is not None:  # given back: each partition runs its own (docstring)
                outcomes.append(Outcome.ABANDONED)
                return outcomes
            for k in range(i, max(j, i + 1)):
                if abandon():
                    outcomes.append(Outcome.ABANDONED)
                    return outcomes
                outcome = await self.messages.process(records[k], abandon, parsed[k])
                outcomes.append(outcome)
                if outcome is Outcome.ABANDONED:
                    return outcomes
                self._observe([records[k]], [outcome])
            i = max(j, i + 1)
        return outcomes

    def _observe(self, records: Sequence[Record], outcomes: Sequence[Outcome]) -> None:
        # Per partition: its last offset here and whether any of its records was a duplicate.
        last: dict[tuple[str, int], tuple[int, bool]] = {}
        for record, outcome in zip(records, outcomes, strict=False):
            tp = (record.topic, record.partition)
            seen = last.get(tp, (0, False))[1] or outcome in _SEEN
            last[tp] = (record.offset, seen)
        for (topic, partition), (offset, duplicate) in last.items():
            self.deps.hint_policy.observe(topic, partition, offset, duplicate)

    def _consult(self, records: Sequence[Record]) -> bool:
        # Ask Redis when the hint policy says so for any partition of the run (its first record).
        policy, asked = self.deps.hint_policy, set()
        for record in records:
            tp = (record.topic, record.partition)
            if tp not in asked:
                asked.add(tp)
                if policy.consult(record.topic, record.partition, record.offset):
                    return True
        return False

    def _batchable_run(
        self, parsed: Sequence[Parsed], start: int, records: Sequence[Record]
    ) -> tuple[int, Registered | None]:
        # The end of the run of events starting at ``start`` that may share a transaction.
        # An operator's replay of a dead-letter record goes alone (the per-message path
        # decides whether this group runs it).
        deps = self.deps
        limit = 1 if deps.lock is not None else deps.config.batch_max_records
        kind: Registered | None = None
        end = start
        while end < len(parsed) and end - start < limit:
            event = parsed[end]
            if not isinstance(event, EventEnvelope) or replay_target(records[end].headers):
                break
            registered = deps.handlers.get(event.event_type)
            if registered is None or (kind is not None and registered.is_async != kind.is_async):
                break
            kind = kind or registered
            end += 1
        return end, kind

    async def _apply(
        self,
        records: Sequence[Record],
        events: list[EventEnvelope],
        kind: Registered,
        lending: bool = False,
    ) -> list[Outcome] | None:
        deps = self.deps
        group, dedup, metrics = deps.group_id, deps.dedup, self.metrics
        ids = [e.event_id for e in events]
        done: set[uuid.UUID] = set()
        if dedup is not None and self._consult(records):
            done = await deps.gate.call(lambda: dedup.done_among(group, ids), set())
        outcomes: list[Outcome] = [Outcome.DUPLICATE] * len(events)
        todo: list[tuple[int, EventEnvelope, Record]] = []
        seen: set[uuid.UUID] = set()
        for k, (record, event) in enumerate(zip(records, events, strict=True)):
            if event.event_id in done:
                metrics.duplicates_redis.inc()
            elif event.event_id in seen:
                metrics.duplicates_db.inc()  # a second copy within this batch
            else:
                seen.add(event.event_id)
                todo.append((k, event, record))
        if not todo:
            return outcomes
        tx = deps.open_tx(kind.is_async)
        started = time.perf_counter()
        try:
            claimed = await deps.store.claim_many(
                tx, [(e.event_id, e.event_type, r) for _k, e, r in todo]
            )
            if len(claimed) < len(todo):  # the duplicate path only: which rows are final
                others = [e.event_id for _k, e, _r in todo if e.event_id not in claimed]
                found = await deps.store.statuses(tx, others)
                for k, event, _record in todo:
                    if event.event_id not in claimed:
                        outcome = delivery_outcome(found.get(event.event_id))
                        if outcome is Outcome.ALREADY_DEAD_LETTERED:
                            outcomes[k] = outcome
            batch = tuple(event for _k, event, _r in todo if event.event_id in claimed)
            for k, event, record in todo:
                if event.event_id not in claimed:
                    continue
                ctx: HandlerContext[Any] = HandlerContext(
                    session=tx.session,
                    group_id=group,
                    attempt=1,
                    topic=record.topic,
                    partition=record.partition,
                    offset=record.offset,
                    timestamp_ms=record_timestamp_ms(record),
                    batch=batch,
                )
                # The record's consumer span covers its handler; the run shares one
                # transaction (a rolled-back run goes through the per-message path, where
                # each record gets a span around its own transaction).
                with consumer_span(group, record, event):
                    if deps.hooks.after_begin is not None:
                        await deps.hooks.after_begin(ctx)
                    await tx.call(deps.handlers[event.event_type].fn, ctx, event)
                outcomes[k] = Outcome.APPLIED
            await tx.commit()
        except Exception as exc:
            _log.info(
                "batch of %d records rolled back, reprocessing %s: %r",
                len(todo),
                "each partition's alone" if lending else "one by one",
                exc,
            )
            return None
        finally:
            await tx.aclose()
        elapsed_s = time.perf_counter() - started
        applied = [events[k].event_id for k, _e, _r in todo if outcomes[k] is Outcome.APPLIED]
        for _ in applied:
            metrics.handler_duration.observe(elapsed_s / len(todo))
        for k, event, _record in todo:
            if outcomes[k] is Outcome.APPLIED:
                metrics.observe_latency(event.occurred_at)
        final = [events[k].event_id for k, _e, _r in todo if outcomes[k] is DEAD]
        metrics.processed.inc(len(applied))
        metrics.replayed.inc(sum(1 for replayed in claimed.values() if replayed))
        metrics.duplicates_dead_lettered.inc(len(final))
        metrics.duplicates_db.inc(len(todo) - len(applied) - len(final))
        if applied and deps.hooks.after_db_commit is not None:
            await deps.hooks.after_db_commit(applied)
        if deps.hooks.after_commit is not None:
            for record, outcome in zip(records, outcomes, strict=True):
                await deps.hooks.after_commit(record, outcome)
        if deps.hints is not None:
            # Not for dead-lettered events: a "done" hint would hide their replay. (The ids
            # Redis already knew are not in ``todo``: their key is set.)
            deps.hints.add([event.event_id for k, event, _r in todo if outcomes[k] is not DEAD])
        return outcomes
