"""The ONE place the operator code builds its Kafka clients (``ledgerbox consumer dlq``,
``ledgerbox consumer lag``, the lag of ``consumer check``): each from a
:class:`~ledgerbox._core.kafka.KafkaSettings` (address, TLS, SASL), so that every such client
logs in the same way (docs/security.md)."""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from ledgerbox._core.kafka import KafkaSettings

__all__ = ["admin_client", "consumer_client", "producer_client"]

#: How long one request of an operator's client may take, in ms.
REQUEST_TIMEOUT_MS = 15_000


def consumer_client(kafka: KafkaSettings, **options: Any) -> AIOKafkaConsumer:
    """A consumer that joins no group and commits nothing (it reads by assignment),
    unless ``options`` say otherwise. Not started."""
    values: dict[str, Any] = {
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "request_timeout_ms": REQUEST_TIMEOUT_MS,
        **options,
    }
    return AIOKafkaConsumer(**kafka.client_kwargs(), **values)


def producer_client(kafka: KafkaSettings, **options: Any) -> AIOKafkaProducer:
    """An idempotent producer with ``acks="all"`` (a record is sent once and stored
    durably before ``send_and_wait`` returns). Not started."""
    values: dict[str, Any] = {
        "acks": "all",
        "enable_idempotence": True,
        "request_timeout_ms": REQUEST_TIMEOUT_MS,
        **options,
    }
    return AIOKafkaProducer(**kafka.client_kwargs(), **values)


def admin_client(kafka: KafkaSettings, **options: Any) -> AIOKafkaAdminClient:
    """An admin client (group offsets, topic metadata). Not started."""
    values: dict[str, Any] = {"request_timeout_ms": REQUEST_TIMEOUT_MS, **options}
    return AIOKafkaAdminClient(**kafka.client_kwargs(), **values)
