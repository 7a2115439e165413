"""Settings of the operator commands (``ledgerbox relay dead ...``, ``ledgerbox consumer dlq
...``): the same selection flags on both sides (docs/operations.md, docs/configuration.md).

The selection and the actor are read from the command line only
(:attr:`~ledgerbox._core.settings.Setting.command_line`): a replay or discard acts on what
the operator typed, never on a ``LEDGERBOX_*`` variable left in a shell. Connection
settings (URLs, Kafka security, schema, tables) still come from the environment too."""

from __future__ import annotations

from ledgerbox._core.settings import Setting

__all__ = ["OPERATOR_FILTERS", "OPERATOR_SWITCHES"]

#: The selection settings, shared by ``relay dead`` and ``consumer dlq``.
OPERATOR_FILTERS = (
    Setting("key", str, help="dead/dlq: only this partition key (record key)", command_line=True),
    Setting("event_type", str, help="dead/dlq: only this event type", command_line=True),
    Setting(
        "error",
        str,
        help="dead/dlq: only those whose error contains this (any case)",
        command_line=True,
    ),
    Setting(
        "older_than_s",
        float,
        help="dead: only rows created, dlq: only records dead-lettered, more than this long ago",
        unit="s",
        command_line=True,
    ),
    Setting(
        "limit",
        int,
        default=100,
        help="dead/dlq: at most this many (1..10000)",
        command_line=True,
    ),
    Setting(
        "actor",
        str,
        help="dead/dlq replay|discard: who acts, for the audit trail (default: the OS user)",
        command_line=True,
    ),
)


#: The boolean flags of the operator commands (command line only, never the environment).
OPERATOR_SWITCHES = {
    "dry_run": "Change nothing; show what would change (an audit row is written, flagged)",
    "json": "Print JSON (one document) for scripts",
    "all_matching": "replay|discard without ids: act on everything the filters select",
}
