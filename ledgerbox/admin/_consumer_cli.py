"""``ledgerbox consumer dlq list|show|replay|discard`` and ``ledgerbox consumer lag``: the
inbox side of the operator API on the command line (docs/operations.md).

The settings are the consumer's (:data:`ledgerbox.inbox._cli.CONSUMER_SETTINGS`:
``--database-url`` / ``DATABASE_URL``, ``--kafka-bootstrap-servers`` /
``KAFKA_BOOTSTRAP_SERVERS`` and the ``--kafka-*`` security flags, ``--schema``,
``--inbox-table``), the filters (``--dlq-topic``, ``--group``, ``--key``, ``--event-type``,
``--older-than-s``, ``--error``), the cap ``--limit`` and ``--actor``. ``--json``
prints one JSON document; ``--dry-run`` changes nothing (an audit row is written, flagged);
``--all`` lists records already replayed or discarded too. The selection flags (``--group``
and ``--topic`` included) and ``--actor`` are read from the command line only;
``--all-matching`` needs a filter besides ``--dlq-topic``; a selection that matches nothing is
refused without an audit row; ``lag`` of a group that committed nothing anywhere is refused
(it names the groups the brokers know). An expected failure prints ONE line on stderr, the
cause and the fix, and exits 2.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from ledgerbox._core.errors import ConfigurationError, LedgerboxError
from ledgerbox._core.kafka import KAFKA_SETTING_NAMES, KafkaSettings
from ledgerbox._core.operator_settings import OPERATOR_SWITCHES
from ledgerbox._core.settings import Values
from ledgerbox.admin._output import (
    database,
    fail,
    log_actions,
    print_json,
    run,
    setting_problem,
    short,
    table,
)
from ledgerbox.inbox._cli import CONSUMER_SETTINGS
from ledgerbox.inbox._cli import app as consumer_app

if TYPE_CHECKING:
    from ledgerbox.admin._types import ActionResult, Database, DlqFilter, PartitionLag

__all__ = ["consumer_app", "dlq_app"]

T = TypeVar("T")

dlq_app = typer.Typer(
    help="Dead-letter records: list, show, replay (to their consumer group only), discard.",
    pretty_exceptions_show_locals=False,
    no_args_is_help=True,
)
consumer_app.add_typer(dlq_app, name="dlq")

_CONNECTION = ["database_url", "kafka_bootstrap_servers", *KAFKA_SETTING_NAMES]
_DB = [*_CONNECTION, "schema", "inbox_table"]
_FILTERS = ["dlq_topic", "group", "key", "event_type", "older_than_s", "error", "limit"]
#: Also used by `consumer check` / `purge` (which read their variables): here, flags only.
_TYPED = ["group", "topic", "older_than_s"]
_LIST_SWITCHES = {
    "json": OPERATOR_SWITCHES["json"],
    "all": "Also records already replayed or discarded",
}
_ACT_SWITCHES = {
    "dry_run": OPERATOR_SWITCHES["dry_run"],
    "json": OPERATOR_SWITCHES["json"],
    "all_matching": OPERATOR_SWITCHES["all_matching"],
}


def _kafka(command: str, values: Values) -> KafkaSettings:
    servers = values["kafka_bootstrap_servers"]
    if not servers:
        missing = ConfigurationError(
            "no Kafka bootstrap servers", setting="kafka_bootstrap_servers"
        )
        raise _fail(command, setting_problem(missing, CONSUMER_SETTINGS))
    try:
        return KafkaSettings.from_values(values, bootstrap_servers=servers)
    except ConfigurationError as exc:
        raise _fail(command, setting_problem(exc, CONSUMER_SETTINGS)) from None


def _fail(command: str, exc: BaseException | str) -> typer.Exit:
    return fail(f"ledgerbox consumer {command}", exc)


def _run(
    command: str,
    make: Callable[[], Coroutine[Any, Any, T]],
    db: Database | None = None,
    kafka: KafkaSettings | None = None,
) -> T:
    return run(f"ledgerbox consumer {command}", make, db, kafka)


def _database(command: str, values: Values) -> Database:
    return database(f"ledgerbox consumer {command}", values, CONSUMER_SETTINGS, inbox_table="inbox")


def _filter(command: str, values: Values, *, include_done: bool = False) -> DlqFilter:
    from ledgerbox.admin._types import DlqFilter

    if not values["dlq_topic"]:
        raise _fail(
            command,
            ConfigurationError("no dead-letter topic: set --dlq-topic (e.g. orders.dlq)"),
        )
    try:
        return DlqFilter(
            dlq_topic=values["dlq_topic"],
            group=values["group"],
            key=values["key"],
            event_type=values["event_type"],
            older_than_s=values["older_than_s"],
            error=values["error"],
            include_done=include_done,
            limit=values["limit"] if values["limit"] is not None else 100,
        )
    except LedgerboxError as exc:
        raise _fail(command, exc) from None


@CONSUMER_SETTINGS.typer_command(
    dlq_app,
    "list",
    [*_DB, *_FILTERS],
    switches=_LIST_SWITCHES,
    command_line=_TYPED,
    full_name="consumer dlq list",
)
def list_command(values: Values, ctx: typer.Context) -> None:
    """List the records of a dead-letter topic (partition, offset order) with their group
    and error; replayed and discarded ones only with --all."""
    from ledgerbox import admin

    selection = _filter("dlq list", values, include_done=values["all"])
    kafka, db = _kafka("dlq list", values), _database("dlq list", values)
    found = _run("dlq list", lambda: admin.list_dlq_records(kafka, db, selection), db, kafka)
    if values["json"]:
        print_json([r.to_json() for r in found])
        return
    if not found:
        typer.echo(f"no dead-letter records in {selection.dlq_topic}")
        return
    rows = [["ref", "group", "event id", "key", "event type", "state", "dead-lettered", "error"]]
    for r in found:
        error = f"{(r.error_type or '-').rsplit('.', 1)[-1]}: {r.error_message or ''}"
        rows.append(
            [
                r.ref,
                r.group or "-",
                r.event_id or "-",
                r.key or "-",
                r.event_type or "-",
                r.state,
                r.dead_lettered_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
                short(error),
            ]
        )
    table(rows)


@CONSUMER_SETTINGS.typer_command(
    dlq_app,
    "show",
    _DB,
    switches={"json": OPERATOR_SWITCHES["json"]},
    arguments={"refs": "Record reference <dlq topic>:<partition>:<offset>"},
    full_name="consumer dlq show",
)
def show_command(values: Values, ctx: typer.Context) -> None:
    """Show one dead-letter record: its headers, error, source and value."""
    from ledgerbox import admin
    from ledgerbox.admin._errors import InvalidFilterError

    if len(values["refs"]) != 1:
        raise _fail("dlq show", InvalidFilterError("give exactly one record reference"))
    kafka, db = _kafka("dlq show", values), _database("dlq show", values)
    record = _run(
        "dlq show", lambda: admin.show_dlq_record(kafka, db, values["refs"][0]), db, kafka
    )
    if values["json"]:
        print_json(record.to_json())
        return
    for name, value in record.to_json().items():
        if name == "headers":
            typer.echo("headers:")
            for key, text in value:
                typer.echo(f"  {key}: {text}")
            continue
        typer.echo(f"{name.replace('_', ' ')}: {'-' if value is None else value}")


def _act(command: str, values: Values) -> None:
    from ledgerbox import admin
    from ledgerbox.admin._errors import InvalidFilterError

    name = f"dlq {command}"
    refs = list(values["refs"])
    narrowed = any(values[n] is not None for n in _FILTERS if n not in ("limit", "dlq_topic"))
    if refs and (narrowed or values["all_matching"]):
        raise _fail(name, InvalidFilterError("give refs or --all-matching with filters, not both"))
    if not refs and not values["all_matching"]:
        raise _fail(
            name,
            InvalidFilterError(
                "give the record references to act on (<dlq topic>:<partition>:<offset>), or "
                "--all-matching with --dlq-topic and a filter (--group, --key, --event-type, "
                "--older-than-s, --error; --limit caps how many) for every record the filters "
                "select"
            ),
        )
    if not refs and not narrowed:
        raise _fail(
            name,
            InvalidFilterError(
                "--all-matching without a filter would select every record of the "
                "dead-letter topic: narrow it with --group, --key, --event-type, "
                "--older-than-s or --error (every one, deliberately: --older-than-s 0)"
            ),
        )
    selection = None if refs else _filter(name, values)
    kafka, db = _kafka(name, values), _database(name, values)
    log_actions()
    function = admin.replay_dlq_records if command == "replay" else admin.discard_dlq_records
    result = _run(
        name,
        lambda: function(
            kafka, db, refs, filter=selection, actor=values["actor"], dry_run=values["dry_run"]
        ),
        db,
        kafka,
    )
    if values["json"]:
        print_json(result.to_json())
        return
    typer.echo(_summary(command, result))


def _summary(command: str, result: ActionResult) -> str:
    records = f"{len(result.ids)} dead-letter record{'s' if len(result.ids) != 1 else ''}"
    listed = ", ".join(result.ids) or "-"
    audit = f"(audit {result.audit_id}, actor {result.actor})"
    if result.dry_run:
        return f"dry run: would {command} {records}: {listed}; nothing changed {audit}"
    if command == "replay":
        return (
            f"replayed {records}: {listed}; republished to their source topics for their "
            f"groups only {audit}"
        )
    return f"discarded {records}: {listed}; {result.changed} newly discarded {audit}"


@CONSUMER_SETTINGS.typer_command(
    dlq_app,
    "replay",
    [*_DB, *_FILTERS, "actor"],
    switches=_ACT_SWITCHES,
    arguments={"refs": "Record references <dlq topic>:<partition>:<offset>"},
    command_line=_TYPED,
    full_name="consumer dlq replay",
)
def replay_command(values: Values, ctx: typer.Context) -> None:
    """Replay dead-letter records for the group that dead-lettered each: its inbox row is
    marked for replay, the record is republished to its source topic (in source order) and
    only that group runs it, once."""
    _act("replay", values)


@CONSUMER_SETTINGS.typer_command(
    dlq_app,
    "discard",
    [*_DB, *_FILTERS, "actor"],
    switches=_ACT_SWITCHES,
    arguments={"refs": "Record references <dlq topic>:<partition>:<offset>"},
    command_line=_TYPED,
    full_name="consumer dlq discard",
)
def discard_command(values: Values, ctx: typer.Context) -> None:
    """Discard dead-letter records (recorded: hidden from lists, never replayed; the events
    stay dead-lettered for their groups)."""
    _act("discard", values)


@CONSUMER_SETTINGS.typer_command(
    consumer_app,
    "lag",
    [*_CONNECTION[1:], "group", "topic"],
    switches={"json": OPERATOR_SWITCHES["json"]},
    command_line=_TYPED,
    full_name="consumer lag",
)
def lag_command(values: Values, ctx: typer.Context) -> None:
    """Lag of a consumer group per partition: committed offset, high watermark, records
    behind (a read: no group is joined, nothing committed)."""
    from ledgerbox import admin
    from ledgerbox.admin._errors import InvalidFilterError

    if not values["group"]:
        raise _fail("lag", InvalidFilterError("no consumer group: set --group"))
    if values["topic"] is not None and not values["topic"].strip(" ,"):
        raise _fail(
            "lag",
            InvalidFilterError(
                f"the topic filter is empty ({values['topic']!r}; an unset shell variable?): "
                "give the topics, or leave --topic out (the topics the group committed on)"
            ),
        )
    kafka = _kafka("lag", values)
    topics = [t.strip() for t in (values["topic"] or "").split(",") if t.strip()] or None

    async def read() -> list[PartitionLag]:
        from ledgerbox.admin._lag import no_offsets_error

        found = await admin.consumer_lag(kafka, values["group"], topics)
        if not found and not topics:  # a misspelt group: say so, exit 2 (docs/operations.md)
            raise await no_offsets_error(kafka, values["group"])
        return found

    found = _run("lag", read, kafka=kafka)
    if values["json"]:
        print_json([p.to_json() for p in found])
        return
    rows = [["topic", "partition", "committed", "high watermark", "lag"]]
    for p in found:
        committed = "-" if p.committed is None else str(p.committed)
        rows.append([p.topic, str(p.partition), committed, str(p.high_watermark), str(p.lag)])
    table(rows)
    typer.echo(f"total lag: {sum(p.lag for p in found)}")
