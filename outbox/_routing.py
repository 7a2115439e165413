"""Topic routing: which Kafka topic an event goes to."""

from __future__ import annotations

from collections.abc import Mapping

from ledgerbox._core.identifiers import kafka_topic
from ledgerbox.outbox._errors import UnroutedEventError

__all__ = ["TopicRouter"]


class TopicRouter:
    """Route events to topics by event type first, then by aggregate type, then a default.

    Parameters
    ----------
    by_event_type : Mapping[str, str]
        ``{"PaymentSucceeded": "payments.events"}``; checked first.
    by_aggregate_type : Mapping[str, str]
        ``{"order": "orders.events"}``; checked when the event type has no route.
    default : str | None
        Topic for everything else; ``None`` makes unrouted events an error.

    Raises
    ------
    ConfigurationError
        If a topic is not a legal Kafka topic name.
    """

    def __init__(
        self,
        by_event_type: Mapping[str, str] | None = None,
        by_aggregate_type: Mapping[str, str] | None = None,
        default: str | None = None,
    ) -> None:
        self._by_event_type = {k: kafka_topic(v) for k, v in (by_event_type or {}).items()}
        self._by_aggregate_type = {k: kafka_topic(v) for k, v in (by_aggregate_type or {}).items()}
        self._default = None if default is None else kafka_topic(default)

    def route(self, event_type: str, aggregate_type: str) -> str:
        """Return the topic for an event.

        Raises
        ------
        UnroutedEventError
            If neither map has a route and there is no default topic.
        """
        topic = self._by_event_type.get(event_type) or self._by_aggregate_type.get(aggregate_type)
        if topic is None:
            topic = self._default
        if topic is None:
            raise UnroutedEventError(event_type, aggregate_type)
        return topic
