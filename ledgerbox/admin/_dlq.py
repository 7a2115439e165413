"""The inbox side of the operator API: records of a dead-letter topic, replayed to the one
consumer group that dead-lettered them, or discarded (docs/operations.md).

Every consumer group of a topic shares its dead-letter topic; each record names its group
(header ``ledgerbox_consumer_group``). A replay, in ONE operator action:

1. in one database transaction: the group's inbox row of the event becomes
   REPLAY_REQUESTED (the inbox's replay hook), the audit row is written and the record is
   marked ``replayed`` (``ledgerbox_dlq_action``);
2. the record is republished to its source topic and partition, with its key, value and
   original headers, plus ``ledgerbox_replay_group`` (the target group) and
   ``ledgerbox_replay_id`` (the audit id); records of one call go one at a time, in (source
   topic, partition, offset) order, so one key's records keep their order.

The target group's next delivery takes the REPLAY_REQUESTED row over and runs the handler
once; every other group acknowledges the record without running anything (it applied the
event already, or dead-lettered it itself: final for it). A replay of an event the group
applied meanwhile is a duplicate for it (the inbox row is DONE, never REPLAY_REQUESTED).
A discard records the decision (Kafka cannot delete a record): lists hide the record and a
replay refuses it; the group's inbox row stays (or, for a replay not applied yet, goes back
to) DEAD_LETTERED, so the group never runs the event; a replay already applied cannot be
discarded.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord

from ledgerbox._core.errors import BrokerError
from ledgerbox._core.faults import Fault
from ledgerbox._core.kafka import KafkaSettings
from ledgerbox._core.kafka_clients import consumer_client, producer_client
from ledgerbox._core.names import H_ID, H_TYPE
from ledgerbox.admin._audit import AdminStore, log_action
from ledgerbox.admin._errors import InvalidFilterError, NotFoundError, RefusedError
from ledgerbox.admin._types import ActionResult, Database, DlqFilter, DlqRecord, audit_actor
from ledgerbox.inbox._deadletter import (
    H_ATTEMPTS,
    H_CONSUMER_GROUP,
    H_ERROR_MESSAGE,
    H_ERROR_TYPE,
    H_REPLAY_GROUP,
    H_REPLAY_ID,
    H_SOURCE_OFFSET,
    H_SOURCE_PARTITION,
    H_SOURCE_TOPIC,
)

__all__ = ["discard_dlq_records", "list_dlq_records", "replay_dlq_records", "show_dlq_record"]

REPLAY = "consumer.dlq.replay"
DISCARD = "consumer.dlq.discard"
#: How long reading a dead-letter topic up to its end may take, in seconds.
READ_TIMEOUT_S = 30.0
#: The dead-letter headers a replayed record does not carry (the reason is in the audit).
_DLQ_ONLY = frozenset(
    {H_ERROR_TYPE, H_ERROR_MESSAGE, H_ATTEMPTS, H_SOURCE_TOPIC, H_SOURCE_PARTITION}
    | {H_SOURCE_OFFSET, H_CONSUMER_GROUP, H_REPLAY_GROUP, H_REPLAY_ID}
)

Ref = tuple[str, int, int]


def parse_ref(ref: str) -> Ref:
    """``"orders.dlq:0:12"`` -> ``("orders.dlq", 0, 12)``.

    Raises
    ------
    ledgerbox.admin.InvalidFilterError
        Not ``<topic>:<partition>:<offset>`` with integers >= 0.
    """
    parts = ref.rsplit(":", 2)
    try:
        topic, partition, offset = parts[0], int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        topic, partition, offset = "", -1, -1
    if not topic or partition < 0 or offset < 0:
        raise InvalidFilterError(
            f"{ref!r} is not a dead-letter record reference: use <dlq topic>:<partition>:"
            "<offset> as `ledgerbox consumer dlq list` prints it",
            setting="ref",
        )
    return topic, partition, offset


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", "replace")


def _int(value: bytes | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _decode(
    record: ConsumerRecord[bytes, bytes], state: str, *, with_value: bool = False
) -> DlqRecord:
    headers = [(k, v) for k, v in (record.headers or ())]
    found = dict(headers)
    return DlqRecord(
        ref=f"{record.topic}:{record.partition}:{record.offset}",
        dlq_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        group=_text(found.get(H_CONSUMER_GROUP)),
        source_topic=_text(found.get(H_SOURCE_TOPIC)),
        source_partition=_int(found.get(H_SOURCE_PARTITION)),
        source_offset=_int(found.get(H_SOURCE_OFFSET)),
        event_id=_text(found.get(H_ID)),
        event_type=_text(found.get(H_TYPE)),
        key=_text(record.key),
        error_type=_text(found.get(H_ERROR_TYPE)),
        error_message=_text(found.get(H_ERROR_MESSAGE)),
        attempts=_int(found.get(H_ATTEMPTS)),
        dead_lettered_at=dt.datetime.fromtimestamp(record.timestamp / 1000, dt.UTC),
        state=state,
        headers=[(k, v.decode("utf-8", "replace")) for k, v in headers],
        value=_text(record.value) if with_value else None,
    )


def _matches(record: DlqRecord, f: DlqFilter, now: dt.datetime) -> bool:
    if not f.include_done and record.state != "dead":
        return False
    if f.group is not None and record.group != f.group:
        return False
    if f.key is not None and record.key != f.key:
        return False
    if f.event_type is not None and record.event_type != f.event_type:
        return False
    if f.older_than_s is not None and not (
        record.dead_lettered_at < now - dt.timedelta(seconds=f.older_than_s)
    ):
        return False
    if f.error is not None:
        text = f"{record.error_type or ''} {record.error_message or ''}".lower()
        if f.error.lower() not in text:
            return False
    return True


async def _partitions(consumer: AIOKafkaConsumer, topic: str, kafka: KafkaSettings) -> list[int]:
    partitions = consumer.partitions_for_topic(topic)
    if not partitions:
        await consumer._client.force_metadata_update()
        partitions = consumer.partitions_for_topic(topic)
    if not partitions:
        raise NotFoundError(
            f"dead-letter topic {topic!r} does not exist on {kafka.describe()} (no record was "
            "ever dead-lettered there, or a wrong --dlq-topic)"
        )
    return sorted(partitions)


async def _read(
    kafka: KafkaSettings, topic: str, wanted: Sequence[tuple[int, int]] | None = None
) -> list[ConsumerRecord[bytes, bytes]]:
    """The records of ``topic`` up to its end (``wanted``: only these (partition, offset)),
    in (partition, offset) order. A reader without a group: nothing is committed."""
    consumer = consumer_client(kafka)
    try:
        await consumer.start()
        partitions = await _partitions(consumer, topic, kafka)
        tps = [TopicPartition(topic, p) for p in partitions]
        end = await consumer.end_offsets(tps)
        begin = await consumer.beginning_offsets(tps)
        wanted_by: dict[int, set[int]] = {}
        if wanted is not None:
            for partition, offset in wanted:
                tp = TopicPartition(topic, partition)
                if partition not in partitions or not begin[tp] <= offset < end[tp]:
                    raise NotFoundError(
                        f"no record {topic}:{partition}:{offset} (the partition's offsets are "
                        f"{_span(begin, end, topic, partition)}): `ledgerbox consumer dlq list` "
                        "shows the records"
                    )
                wanted_by.setdefault(partition, set()).add(offset)
            tps = [TopicPartition(topic, p) for p in sorted(wanted_by)]
        todo = {tp: end[tp] for tp in tps if end[tp] > begin[tp]}
        if not todo:
            return []
        consumer.assign(list(todo))
        for tp in todo:
            start = begin[tp] if wanted is None else min(wanted_by[tp.partition])
            consumer.seek(tp, start)
        records: list[ConsumerRecord[bytes, bytes]] = []
        deadline = time.monotonic() + READ_TIMEOUT_S
        while todo:
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"reading {topic} did not reach its end within {READ_TIMEOUT_S:.0f} s",
                    fault=Fault.TRANSIENT,
                    kind="Timeout",
                )
            batch = await consumer.getmany(*todo, timeout_ms=500)
            for tp, recs in batch.items():
                for record in recs:
                    keep = wanted is None or record.offset in wanted_by[tp.partition]
                    if keep and record.offset < todo.get(tp, -1):
                        records.append(record)
                last = await consumer.position(tp)
                if last >= end[tp] or (wanted is not None and last > max(wanted_by[tp.partition])):
                    todo.pop(tp, None)
    except (KafkaError, OSError) as exc:
        raise BrokerError.translate(
            exc, f"reading dead-letter topic {topic!r}", servers=kafka.bootstrap_servers
        ) from exc
    finally:
        await consumer.stop()
    if wanted is not None:
        got = {(r.partition, r.offset) for r in records}
        for partition, offset in wanted:
            if (partition, offset) not in got:  # compacted away, or a transaction marker
                raise NotFoundError(f"no record {topic}:{partition}:{offset} in the topic")
    return sorted(records, key=lambda r: (r.partition, r.offset))


def _span(
    begin: dict[TopicPartition, int], end: dict[TopicPartition, int], topic: str, p: int
) -> str:
    tp = TopicPartition(topic, p)
    if tp not in begin:
        return "none: no such partition"
    return f"{begin[tp]}..{end[tp] - 1}" if end[tp] > begin[tp] else "none: empty"


async def list_dlq_records(
    kafka: KafkaSettings, db: Database, filter: DlqFilter
) -> list[DlqRecord]:
    """Records of ``filter.dlq_topic`` matching ``filter``, in (partition, offset) order.

    Parameters
    ----------
    kafka : KafkaSettings
    db : Database
        Where the replay / discard decisions are recorded (``ledgerbox_dlq_action``).
    filter : DlqFilter
        Without ``include_done``, records already replayed or discarded are left out.

    Returns
    -------
    list[DlqRecord]
        Without the value (:func:`show_dlq_record` has it). A read: the topic is read from
        its first offset to its end by a reader without a group; nothing is committed.

    Raises
    ------
    ledgerbox.admin.NotFoundError
        The dead-letter topic does not exist.
    ledgerbox.BrokerError, ledgerbox.DatabaseError
        Kafka or the database failed.
    """
    store = AdminStore(db)
    try:
        states = await store.dlq_states(filter.dlq_topic)
    finally:
        await store.aclose()
    now = dt.datetime.now(dt.UTC)
    found: list[DlqRecord] = []
    records = await _read(kafka, filter.dlq_topic)
    if records and not any(
        key == H_ERROR_TYPE for record in records for key, _v in (record.headers or ())
    ):
        # Every dead-letter record ledgerbox ever wrote carries its error type: a topic with
        # records and none of them is not a dead-letter topic (a newcomer's review listed a
        # source topic's events as "dead").
        raise InvalidFilterError(
            f"{filter.dlq_topic} holds no dead-letter records (none of its {len(records)}"
            f" records has the {H_ERROR_TYPE} header): give the dead-letter topic, by default"
            f" {filter.dlq_topic}.dlq"
        )
    for record in records:
        decoded = _decode(record, states.get((record.partition, record.offset), "dead"))
        if _matches(decoded, filter, now):
            found.append(decoded)
            if len(found) >= filter.limit:
                break
    return found


async def show_dlq_record(kafka: KafkaSettings, db: Database, ref: str) -> DlqRecord:
    """One record (``<dlq topic>:<partition>:<offset>``) with its value.

    Raises
    ------
    ledgerbox.admin.InvalidFilterError
        ``ref`` is malformed.
    ledgerbox.admin.NotFoundError
        No such topic or record.
    ledgerbox.BrokerError, ledgerbox.DatabaseError
        Kafka or the database failed.
    """
    topic, partition, offset = parse_ref(ref)
    (record,) = await _read(kafka, topic, [(partition, offset)])
    store = AdminStore(db)
    try:
        states = await store.dlq_states(topic)
    finally:
        await store.aclose()
    return _decode(record, states.get((partition, offset), "dead"), with_value=True)


async def _select(
    kafka: KafkaSettings,
    db: Database,
    refs: Sequence[str],
    filter: DlqFilter | None,
) -> tuple[list[tuple[DlqRecord, ConsumerRecord[bytes, bytes]]], dict[str, Any]]:
    if bool(refs) == (filter is not None):
        raise InvalidFilterError(
            "give either dead-letter record references or a filter, not both and not neither "
            "(command line: refs, or --all-matching with --group/--key/--event-type/...)",
            setting="refs",
        )
    store = AdminStore(db)
    try:
        if filter is not None:
            states = await store.dlq_states(filter.dlq_topic)
            now = dt.datetime.now(dt.UTC)
            chosen = []
            for record in await _read(kafka, filter.dlq_topic):
                decoded = _decode(record, states.get((record.partition, record.offset), "dead"))
                if _matches(decoded, filter, now):
                    chosen.append((decoded, record))
                    if len(chosen) >= filter.limit:
                        break
            if not chosen:
                # Nothing to do is not an action: no audit row (docs/operations.md).
                given = {
                    k: v
                    for k, v in filter.to_json().items()
                    if v is not None and k not in ("limit", "include_done")
                }
                raise NotFoundError(
                    f"no dead-letter record matches the filters "
                    f"{' '.join(f'{k}={v!r}' for k, v in sorted(given.items()))}: nothing "
                    "changed, nothing audited; `ledgerbox consumer dlq list` with the same "
                    "filters shows what they select"
                )
            return chosen, filter.to_json()
        parsed = [parse_ref(r) for r in refs]
        by_topic: dict[str, list[tuple[int, int]]] = {}
        for topic, partition, offset in parsed:
            by_topic.setdefault(topic, []).append((partition, offset))
        chosen = []
        for topic, wanted in sorted(by_topic.items()):
            states = await store.dlq_states(topic)
            for record in await _read(kafka, topic, sorted(set(wanted))):
                state = states.get((record.partition, record.offset), "dead")
                chosen.append((_decode(record, state), record))
        return chosen, {"refs": list(refs)}
    finally:
        await store.aclose()


async def replay_dlq_records(
    kafka: KafkaSettings,
    db: Database,
    refs: Sequence[str] = (),
    *,
    filter: DlqFilter | None = None,
    actor: str | None = None,
    dry_run: bool = False,
) -> ActionResult:
    """Replay dead-letter records for the group that dead-lettered each (module docstring).

    Parameters
    ----------
    kafka : KafkaSettings
    db : Database
        The database of the inbox of the records' groups (its inbox row becomes
        REPLAY_REQUESTED) and of the audit trail.
    refs : Sequence[str]
        ``<dlq topic>:<partition>:<offset>`` references; or give ``filter`` (exactly one).
    filter : DlqFilter | None
        Replay the records it selects.
    actor : str | None
        Who acts (audit); ``None``: the OS user; empty or blank: refused.
    dry_run : bool
        Change and send nothing; the audit row is written, flagged.

    Returns
    -------
    ActionResult
        ``ids``: the references, in the order they were sent; ``changed``: records
        republished.

    Raises
    ------
    ledgerbox.admin.InvalidFilterError
        Both or neither of ``refs`` and ``filter``, a malformed reference, or an empty or
        blank ``actor``.
    ledgerbox.admin.NotFoundError
        A referenced record does not exist, or ``filter`` selects none; nothing changed, no
        audit row written.
    ledgerbox.admin.RefusedError
        A record is discarded, names no consumer group (dead-lettered before the header
        existed), no source topic or no event id; nothing changed.
    ledgerbox.BrokerError
        Kafka failed. If it failed while republishing, the database part is committed
        (rows REPLAY_REQUESTED, records marked replayed, audited): run the same replay again
        (by reference, or with ``include_done``); an event that got through already is a
        duplicate for its group.
    ledgerbox.DatabaseError
        The database failed, or the inbox table (``db.inbox_table``) does not exist or may
        not be updated (checked first, a dry run too: no audit row); nothing was sent.
    """
    actor = audit_actor(actor)
    store = AdminStore(db)
    try:  # a wrong --inbox-table: refused before anything, a dry run too (no audit row)
        await store.check_inbox()
    finally:
        await store.aclose()
    chosen, filters = await _select(kafka, db, refs, filter)
    for decoded, _record in chosen:
        why = _refusal(decoded)
        if why is not None:
            raise RefusedError(f"cannot replay {decoded.ref}: {why}")
    # One key's records in their source order (partition then offset within a topic).
    chosen.sort(
        key=lambda c: (c[0].source_topic or "", c[0].source_partition or 0, c[0].source_offset or 0)
    )
    ids = [d.ref for d, _r in chosen]
    store = AdminStore(db)
    try:
        async with store.begin("replay dead-letter records") as conn:
            audited = await store.audit(
                conn,
                actor=actor,
                action=REPLAY,
                dry_run=dry_run,
                filters=filters,
                ids=ids,
                changed=0 if dry_run else len(chosen),
            )
            if not dry_run:
                by_group: dict[str, list[uuid.UUID]] = {}
                for decoded, _r in chosen:
                    assert decoded.group is not None and decoded.event_id is not None
                    by_group.setdefault(decoded.group, []).append(uuid.UUID(decoded.event_id))
                for group, event_ids in sorted(by_group.items()):
                    await store.request_replay(conn, group, event_ids)
                for topic in sorted({d.dlq_topic for d, _r in chosen}):
                    marks = [
                        (d.partition, d.offset, d.group) for d, _r in chosen if d.dlq_topic == topic
                    ]
                    await store.mark_dlq(conn, topic, marks, "replayed", audited.id)
    finally:
        await store.aclose()
    if not dry_run and chosen:
        await _republish(kafka, chosen, audited.id)
    result = ActionResult(
        action=REPLAY,
        actor=actor,
        dry_run=dry_run,
        ids=ids,
        changed=0 if dry_run else len(chosen),
        audit_id=audited.id,
        at=audited.at.astimezone(dt.UTC),
    )
    log_action(result, filters)
    return result


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def _refusal(record: DlqRecord) -> str | None:
    if record.state == "discarded":
        return "it was discarded (a discard is final)"
    if record.error_type is None:
        return (
            f"it is not a dead-letter record (no {H_ERROR_TYPE} header): is"
            f" {record.dlq_topic} the source topic? its dead-letter topic is by default"
            f" {record.dlq_topic}.dlq"
        )
    if record.group is None:
        return (
            "it names no consumer group (no ledgerbox_consumer_group header: dead-lettered by "
            "an older ledgerbox); republish it by hand if every group should see it again"
        )
    if record.source_topic is None or record.source_partition is None:
        return "it names no source topic/partition (not a ledgerbox dead letter)"
    if record.event_id is None:
        return "it has no event id (ce_id): it was not a ledgerbox event; fix its producer"
    if not _is_uuid(record.event_id):
        return (
            f"its event id {record.event_id!r} is not a UUID: not a ledgerbox event, fix its"
            " producer (ce_id must be a UUID)"
        )
    return None


async def _republish(
    kafka: KafkaSettings,
    chosen: Sequence[tuple[DlqRecord, ConsumerRecord[bytes, bytes]]],
    replay_id: int,
) -> None:
    producer = producer_client(kafka)
    try:
        await producer.start()
        for decoded, record in chosen:
            assert decoded.group is not None and decoded.source_topic is not None
            headers = [(k, v) for k, v in (record.headers or ()) if k not in _DLQ_ONLY]
            headers += [
                (H_REPLAY_GROUP, decoded.group.encode()),
                (H_REPLAY_ID, str(replay_id).encode()),
            ]
            # One at a time: the next is sent only once this one is stored (per-key order).
            await producer.send_and_wait(
                decoded.source_topic,
                value=record.value,
                key=record.key,
                headers=headers,
                partition=decoded.source_partition,
            )
    except (KafkaError, OSError) as exc:
        raise BrokerError.translate(
            exc,
            "republishing the replayed records (the inbox rows are REPLAY_REQUESTED and the "
            "replay is audited: run the same replay again once Kafka is back)",
            servers=kafka.bootstrap_servers,
        ) from exc
    finally:
        await producer.stop()


async def discard_dlq_records(
    kafka: KafkaSettings,
    db: Database,
    refs: Sequence[str] = (),
    *,
    filter: DlqFilter | None = None,
    actor: str | None = None,
    dry_run: bool = False,
) -> ActionResult:
    """Discard dead-letter records: recorded in ``ledgerbox_dlq_action`` (Kafka cannot
    delete a record), so lists hide them and a replay refuses them. The inbox rows stay, or
    go back to, DEAD_LETTERED (final): the groups never run those events. A record replayed
    and not applied yet has its replay cancelled (the group's row goes from REPLAY_REQUESTED
    back to DEAD_LETTERED, so the republished copy is acknowledged without running); one
    whose replay the group already applied is refused. Before 2026-12-04 a discard after a
    replay left the row REPLAY_REQUESTED and the group ran the discarded event (newcomer
    review). Parameters and errors as :func:`replay_dlq_records` (no Kafka write;
    ``changed``: records discarded; the inbox table is checked first). A record discarded
    already is refused (:class:`~ledgerbox.admin.RefusedError`, no audit row), as
    ``relay dead discard`` refuses an event that is no longer dead-lettered.
    """
    actor = audit_actor(actor)
    store = AdminStore(db)
    try:  # the discard updates the inbox table: a wrong --inbox-table is refused first
        await store.check_inbox()
    finally:
        await store.aclose()
    chosen, filters = await _select(kafka, db, refs, filter)
    for decoded, _record in chosen:
        if decoded.state == "discarded":  # as `relay dead discard` refuses a second discard
            raise RefusedError(
                f"cannot discard {decoded.ref}: it was discarded already (a discard is final); "
                "nothing changed, nothing audited"
            )
    ids = [d.ref for d, _r in chosen]
    fresh = [d for d, _r in chosen if d.state != "discarded"]
    store = AdminStore(db)
    try:
        async with store.begin("discard dead-letter records") as conn:
            audited = await store.audit(
                conn,
                actor=actor,
                action=DISCARD,
                dry_run=dry_run,
                filters=filters,
                ids=ids,
                changed=0 if dry_run else len(fresh),
            )
            by_group: dict[str, list[tuple[uuid.UUID, DlqRecord]]] = {}
            for d in fresh:
                if d.group is not None and d.event_id is not None and _is_uuid(d.event_id):
                    by_group.setdefault(d.group, []).append((uuid.UUID(d.event_id), d))
            for group, events in sorted(by_group.items()):
                ids_of_group = [e for e, _d in events]
                if not dry_run:  # waits for a delivery holding the row, then sees it DONE
                    await store.cancel_replay(conn, group, ids_of_group)
                done = set(await store.applied(conn, group, ids_of_group))
                late = [d.ref for e, d in events if e in done]
                if late:  # the transaction rolls back: nothing changed, nothing audited
                    raise RefusedError(
                        f"cannot discard {', '.join(late)}: group {group} applied "
                        f"{'it' if len(late) == 1 else 'them'} after a replay (its effect "
                        "committed; a discard cannot undo it); nothing changed, nothing "
                        "audited"
                    )
            if not dry_run:
                for topic in sorted({d.dlq_topic for d in fresh}):
                    marks = [
                        (d.partition, d.offset, d.group) for d in fresh if d.dlq_topic == topic
                    ]
                    await store.mark_dlq(conn, topic, marks, "discarded", audited.id)
    finally:
        await store.aclose()
    result = ActionResult(
        action=DISCARD,
        actor=actor,
        dry_run=dry_run,
        ids=ids,
        changed=0 if dry_run else len(fresh),
        audit_id=audited.id,
        at=audited.at.astimezone(dt.UTC),
    )
    log_action(result, filters)
    return result
