"""TEST-ONLY entry point of the relay CLI with fault-injection hooks (never used in production).

``python -m tests.relay_entry [--mark-delay-ms N] [--send-delay-ms N] -- run ...`` builds a
:class:`ledgerbox.relay.RelayHooks` and runs the real relay CLI (``ledgerbox.relay._cli``)
with it, in-process: fault cases that need a real process (C02 kills the relay between
"Kafka confirmed" and "marked", C03 delays the first send) set their hooks here instead of
through environment variables read by production code.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence

from ledgerbox.relay import RelayHooks
from ledgerbox.relay._cli import main as relay_main


def _sleep(ms: int) -> Callable[[], Awaitable[None]] | None:
    if ms <= 0:
        return None

    async def pause() -> None:
        await asyncio.sleep(ms / 1000)

    return pause


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    ours, relay_args = (
        (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else ([], args)
    )
    parser = argparse.ArgumentParser(prog="python -m tests.relay_entry")
    parser.add_argument("--mark-delay-ms", type=int, default=0, help="after_confirm: sleep, ms")
    parser.add_argument("--send-delay-ms", type=int, default=0, help="before_first_send, ms")
    opts = parser.parse_args(ours)
    hooks = RelayHooks(
        before_first_send=_sleep(opts.send_delay_ms), after_confirm=_sleep(opts.mark_delay_ms)
    )
    relay_main(relay_args, hooks=hooks)


if __name__ == "__main__":
    main()
