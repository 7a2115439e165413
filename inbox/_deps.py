"""What the steps of one inbox consumer use, in one frozen object (STYLE rule 15).

:class:`inbox.InboxConsumer` builds a :class:`PipelineDeps` once and hands it to its steps
(:mod:`inbox._message`, :mod:`inbox._batch`, :mod:`inbox._deadletterer`,
:mod:`inbox._runner`), so that no step reads the consumer's private attributes and no step
module imports the consumer's (the import graph stays acyclic).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ledgerbox.inbox._config import ConsumerConfig
from ledgerbox.inbox._deadletter import DeadLetterPublisher
from ledgerbox.inbox._gate import RedisGate
from ledgerbox.inbox._handlers import ConsumerHooks, Registered
from ledgerbox.inbox._health import ConsumerHealth
from ledgerbox.inbox._hints import DoneHintWriter, HintPolicy
from ledgerbox.inbox._metrics import GroupMetrics
from ledgerbox.inbox._redis import AggregateLock, DedupStore
from ledgerbox.inbox._store import InboxStore
from ledgerbox.inbox._tx import Tx

__all__ = ["PipelineDeps"]


@dataclass(frozen=True, slots=True)
class PipelineDeps:
    """The dependencies of one consumer's steps, fixed when the consumer is built.

    Attributes
    ----------
    config : ConsumerConfig
        The consumer's settings.
    group_id : str
        The consumer group (``config.group_id``): the dedup scope and the metric label.
    store : InboxStore
        The inbox's storage seam for this group.
    handlers : Mapping[str, Registered]
        Registered handlers by event type: a read-only live view, so that handlers
        registered after the consumer was built are seen. No entry: ``config.on_unhandled``.
    dedup : DedupStore | None
        The Redis fast-path store; ``None``: the database alone decides.
    lock : AggregateLock | None
        The per-aggregate lock; ``None``: no locking.
    gate : RedisGate
        The Redis circuit every ``dedup`` and ``lock`` call goes through.
    dead_letters : DeadLetterPublisher
        Where poison records go.
    metrics : GroupMetrics
        The group's metric series.
    health : ConsumerHealth
        Where a step reports a fault of the environment that stops it (health ``down``).
    hooks : ConsumerHooks
        Test-only fault injection (every hook unset in production).
    open_tx : Callable[[bool], Tx]
        ``open_tx(is_async)``: a new transaction, on an ``AsyncSession`` when ``is_async``,
        else on a sync ``Session`` driven from a worker thread. The caller closes it.
    hint_policy : HintPolicy
        Per partition, whether a record or run reads Redis before the database
        (:mod:`inbox._hints`); both paths report what they found to it.
    hints : DoneHintWriter | None
        Writes "done" hints in the background after the commit; ``None`` without ``dedup``.
    """

    config: ConsumerConfig
    group_id: str
    store: InboxStore
    handlers: Mapping[str, Registered]
    dedup: DedupStore | None
    lock: AggregateLock | None
    gate: RedisGate
    dead_letters: DeadLetterPublisher
    metrics: GroupMetrics
    health: ConsumerHealth
    hooks: ConsumerHooks
    open_tx: Callable[[bool], Tx]
    hint_policy: HintPolicy
    hints: DoneHintWriter | None
