"""``await_unless_abandoned``: a dead-letter send in flight gets at most its grace once the
record is abandoned (stop, revoke), and nothing is cut short before (docs/operations.md,
"Stopping a daemon"). Pure asyncio, no services; no wall-clock upper bound is asserted."""

from __future__ import annotations

import asyncio

import pytest

from ledgerbox.inbox._record import Abandon, await_unless_abandoned


async def test_a_send_that_finishes_is_returned_never_abandoned() -> None:
    async def send() -> str:
        await asyncio.sleep(0.02)
        return "stored"

    assert await await_unless_abandoned(send(), lambda: False, grace_s=0.0) == "stored"


async def test_a_send_that_finishes_within_the_grace_after_the_abandon_is_kept() -> None:
    abandoned = False
    done = asyncio.Event()

    async def send() -> str:
        await done.wait()
        return "stored"

    async def later() -> None:
        nonlocal abandoned
        abandoned = True
        await asyncio.sleep(0.15)  # past the first poll after the abandon
        done.set()

    helper = asyncio.create_task(later())
    assert await await_unless_abandoned(send(), lambda: abandoned, grace_s=60.0) == "stored"
    await helper


async def test_a_send_still_waiting_after_the_grace_is_cancelled_and_abandoned() -> None:
    cancelled = asyncio.Event()

    async def send() -> None:
        try:
            await asyncio.Event().wait()  # a broker that never answers
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(Abandon):
        await await_unless_abandoned(send(), lambda: True, grace_s=0.1)
    await asyncio.wait_for(cancelled.wait(), 5)


async def test_an_error_of_the_send_propagates_unchanged() -> None:
    async def send() -> None:
        raise OSError("connection refused")

    with pytest.raises(OSError, match="connection refused"):
        await await_unless_abandoned(send(), lambda: True, grace_s=1.0)


async def test_a_dead_letter_producer_start_given_up_leaves_nothing_unclosed() -> None:
    # A broker that accepts the connection and never answers (a local socket, no Kafka):
    # the first dead-letter send of an outage is given up while aiokafka still starts the
    # producer. Before: the half-started producer was left behind and aiokafka logged
    # "Unclosed AIOKafkaProducer" when it was collected.
    import gc

    from ledgerbox.inbox._deadletter import KafkaDeadLetterPublisher

    held: list[asyncio.StreamWriter] = []

    async def never_answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(str(context["message"])))
    publisher = KafkaDeadLetterPublisher(f"127.0.0.1:{port}")
    try:
        with pytest.raises(Abandon):
            await await_unless_abandoned(
                publisher.publish("dlq", b"k", b"v", []), lambda: True, grace_s=0.3
            )
        await asyncio.wait_for(publisher.aclose(), 10)
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0.1)
    finally:
        loop.set_exception_handler(None)
        for writer in held:
            writer.close()
        server.close()
    assert not any("Unclosed" in message for message in reported), reported
