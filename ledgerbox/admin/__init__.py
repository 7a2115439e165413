"""ledgerbox.admin: the operator API (dead-lettered outbox events, dead-letter records,
consumer lag, the audit trail). The CLI (``ledgerbox relay dead ...``, ``ledgerbox consumer
dlq ...``, ``ledgerbox consumer lag``) and the console call exactly these functions.

Every function is ``async``, opens its own connections and closes them before it returns.
Every replay and discard (dry runs too, flagged) writes one audit row and one INFO log line
on logger ``ledgerbox.admin``; one whose filter selects nothing raises
:class:`NotFoundError` and writes none (nothing was done). The guide: docs/operations.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ledgerbox._core.lazy import lazy_exports

if TYPE_CHECKING:
    from ledgerbox._core.kafka import KafkaSettings
    from ledgerbox.admin._audit import list_audit
    from ledgerbox.admin._dead import (
        discard_dead_events,
        held_keys,
        list_dead_events,
        relay_status,
        replay_dead_events,
        show_dead_event,
    )
    from ledgerbox.admin._dlq import (
        discard_dlq_records,
        list_dlq_records,
        replay_dlq_records,
        show_dlq_record,
    )
    from ledgerbox.admin._errors import AdminError, InvalidFilterError, NotFoundError, RefusedError
    from ledgerbox.admin._lag import consumer_lag
    from ledgerbox.admin._types import (
        ActionResult,
        AuditEntry,
        Database,
        DeadEvent,
        DeadFilter,
        DlqFilter,
        DlqRecord,
        HeldKey,
        PartitionLag,
        RelayStatus,
        ShardOwner,
        default_actor,
    )

__all__ = [
    "ActionResult",
    "AdminError",
    "AuditEntry",
    "Database",
    "DeadEvent",
    "DeadFilter",
    "DlqFilter",
    "DlqRecord",
    "HeldKey",
    "InvalidFilterError",
    "KafkaSettings",
    "NotFoundError",
    "PartitionLag",
    "RefusedError",
    "RelayStatus",
    "ShardOwner",
    "consumer_lag",
    "default_actor",
    "discard_dead_events",
    "discard_dlq_records",
    "held_keys",
    "list_audit",
    "list_dead_events",
    "list_dlq_records",
    "relay_status",
    "replay_dead_events",
    "replay_dlq_records",
    "show_dead_event",
    "show_dlq_record",
]

# Lazy (PEP 562): `ledgerbox relay ...` loads this package's CLI without SQLAlchemy.
if not TYPE_CHECKING:  # type checkers see the imports above, so typos stay errors
    __getattr__, __dir__ = lazy_exports(
        __name__,
        globals(),
        {
            "ActionResult": "ledgerbox.admin._types",
            "AdminError": "ledgerbox.admin._errors",
            "AuditEntry": "ledgerbox.admin._types",
            "Database": "ledgerbox.admin._types",
            "DeadEvent": "ledgerbox.admin._types",
            "DeadFilter": "ledgerbox.admin._types",
            "DlqFilter": "ledgerbox.admin._types",
            "DlqRecord": "ledgerbox.admin._types",
            "HeldKey": "ledgerbox.admin._types",
            "InvalidFilterError": "ledgerbox.admin._errors",
            "KafkaSettings": "ledgerbox._core.kafka",
            "NotFoundError": "ledgerbox.admin._errors",
            "PartitionLag": "ledgerbox.admin._types",
            "RefusedError": "ledgerbox.admin._errors",
            "RelayStatus": "ledgerbox.admin._types",
            "ShardOwner": "ledgerbox.admin._types",
            "consumer_lag": "ledgerbox.admin._lag",
            "default_actor": "ledgerbox.admin._types",
            "discard_dead_events": "ledgerbox.admin._dead",
            "discard_dlq_records": "ledgerbox.admin._dlq",
            "held_keys": "ledgerbox.admin._dead",
            "list_audit": "ledgerbox.admin._audit",
            "list_dead_events": "ledgerbox.admin._dead",
            "list_dlq_records": "ledgerbox.admin._dlq",
            "relay_status": "ledgerbox.admin._dead",
            "replay_dead_events": "ledgerbox.admin._dead",
            "replay_dlq_records": "ledgerbox.admin._dlq",
            "show_dead_event": "ledgerbox.admin._dead",
            "show_dlq_record": "ledgerbox.admin._dlq",
        },
    )
