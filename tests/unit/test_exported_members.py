"""Every public name of ledgerbox, pinned in one place (httpx ``tests/test_exported_members.py``).

A change to a public ``__all__`` is an API change: it must change this file too. Each name
must resolve, and each exported exception and class must report the public path it is
exported from (``__module__``), so tracebacks and ``repr`` show what users import.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

PUBLIC: dict[str, list[str]] = {
    "ledgerbox": [
        "BrokerError",
        "ConfigurationError",
        "DatabaseError",
        "LedgerboxError",
        "__version__",
    ],
    "ledgerbox.outbox": [
        "DEFAULT_MAX_FUTURE_S",
        "DEFAULT_MAX_PAYLOAD_BYTES",
        "DEFAULT_MAX_RECORD_BYTES",
        "DEFAULT_SHARD_COUNT",
        "EnvelopeParseError",
        "EventEnvelope",
        "EventIdConflictError",
        "EventStatus",
        "EventValidationError",
        "FutureEventTimeError",
        "NaiveDatetimeError",
        "NonFiniteNumberError",
        "OutboxTable",
        "OutboxWriter",
        "PayloadTooLargeError",
        "RecordTooLargeError",
        "Staged",
        "TopicRouter",
        "UnroutedEventError",
        "envelope_from_kafka",
        "envelope_from_row",
        "idempotency_key",
        "kafka_headers",
        "shard_of",
        "timestamp_ms",
    ],
    "ledgerbox.relay": [
        "KafkaPublisher",
        "KafkaSettings",
        "OutboundRecord",
        "PublishError",
        "Publisher",
        "Relay",
        "RelayConfig",
        "RelayError",
        "RelayHooks",
        "RelayTables",
        "Secret",
        "StoreError",
    ],
    "ledgerbox.relay.testing": ["InMemoryPublisher", "InMemoryRelayStore"],
    "ledgerbox.telemetry": ["FILE_EXPORTER", "configure", "shutdown"],
    "ledgerbox.inbox": [
        "AggregateLock",
        "ConsumerConfig",
        "DedupStore",
        "FencedWriteError",
        "HandlerContext",
        "InboxConsumer",
        "InboxError",
        "InboxStatus",
        "InboxTable",
        "KafkaSettings",
        "LockBusyError",
        "Outcome",
        "RedisAggregateLock",
        "RedisDedupStore",
        "RedisUnavailableError",
        "Secret",
        "StartupError",
        "UnhandledEventError",
        "VersionConflictError",
        "afenced_update",
        "aupdate_versioned",
        "fenced_update",
        "update_versioned",
    ],
    "ledgerbox.inbox.testing": [
        "FakeRecord",
        "InMemoryAggregateLock",
        "InMemoryDeadLetterPublisher",
        "InMemoryDedupStore",
        "ManualClock",
        "kafka_parts",
        "record_for",
    ],
    "ledgerbox.console": [
        "AdminSource",
        "ConsoleConfig",
        "ConsoleSource",
        "ServiceTarget",
        "create_app",
        "load_services_file",
    ],
    "ledgerbox.console.testing": ["InMemorySource", "ServiceData"],
    "ledgerbox.admin": [
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
    ],
    "ledgerbox.migrations": [
        "VERSION_TABLE",
        "MigrationError",
        "Names",
        "alembic_config",
        "include_tables",
        "target_metadata",
        "upgrade_database",
    ],
    "ledgerbox.migrations.ops": [
        "create_inbox_v1",
        "create_ops_v3",
        "create_outbox_v1",
        "create_relay_v1",
        "downgrade_outbox_v2_to_v1",
        "downgrade_outbox_v4_to_v3",
        "downgrade_relay_v2_to_v1",
        "drop_inbox_v1",
        "drop_ops_v3",
        "drop_outbox_v1",
        "drop_relay_v1",
        "upgrade_outbox_v1_to_v2",
        "upgrade_outbox_v3_to_v4",
        "upgrade_relay_v1_to_v2",
    ],
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_public_names_are_pinned(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert sorted(module.__all__) == sorted(PUBLIC[module_name])
    for name in module.__all__:
        assert getattr(module, name) is not None, name


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_exceptions_report_their_public_import_path(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in module.__all__:
        value = getattr(module, name)
        if inspect.isclass(value) and issubclass(value, BaseException):
            home = importlib.import_module(value.__module__)
            assert name in getattr(home, "__all__", ()), (
                f"{module_name}.{name} reports __module__ {value.__module__!r}, "
                "which does not export it"
            )


def test_every_error_has_the_one_root() -> None:
    from ledgerbox import LedgerboxError

    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) and issubclass(value, Exception):
                assert issubclass(value, LedgerboxError), f"{module_name}.{name}"
