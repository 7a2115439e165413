"""Settings of the operator commands (``ledgerbox relay dead ...``, ``ledgerbox consumer dlq
...``): the same selection flags on both sides (docs/operations.md, docs/configuration.md)."""

from __future__ import annotations

from ledgerbox._core.settings import Setting

__all__ = ["OPERATOR_FILTERS", "OPERATOR_SWITCHES"]

#: The selection settings, shared by ``relay dead`` and ``consumer dlq``.
OPERATOR_FILTERS = (
    Setting("key", str, help="dead/dlq: only this partition key (record key)"),
    Setting("event_type", str, help="dead/dlq: only this event type"),
    Setting("error", str, help="dead/dlq: only those whose error contains this (any case)"),
    Setting(
        "older_than_s",
        float,
        help="dead: only rows created, dlq: only records dead-lettered, more than this long ago",
        unit="s",
    ),
    Setting("limit", int, default=100, help="dead/dlq: at most this many (1..10000)"),
    Setting(
        "actor",
        str,
        help="dead/dlq replay|discard: who acts, for the audit trail (default: the OS user)",
    ),
)


#: The boolean flags of the operator commands (command line only, never the environment).
OPERATOR_SWITCHES = {
    "dry_run": "Change nothing; show what would change (an audit row is written, flagged)",
    "json": "Print JSON (one document) for scripts",
    "all_matching": "replay|discard without ids: act on everything the filters select",
}
