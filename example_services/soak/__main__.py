"""``python -m example_services.soak``: see ``--help``. ``make soak`` runs it on the cluster.

Environment (flags win): ``SOAK_S`` duration in seconds (default 1800), ``SOAK_SEED`` (default
random, always printed), ``SOAK_RATE`` orders per second (default 20),
``LEDGERBOX_SOAK_PLANT_BUG`` (``skip-inbox`` | ``ack-before-commit``: the soak's self-test).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from example_services.soak._run import PLANT_BUG_ENV, SoakOptions, run_soak
from example_services.soak.schedule import KIND_NAMES, minimum_duration_s


def _kinds(value: str) -> tuple[str, ...]:
    chosen = tuple(k.strip() for k in value.split(",") if k.strip())
    unknown = sorted(set(chosen) - set(KIND_NAMES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fault kind(s) {unknown}; known: {KIND_NAMES}")
    return chosen


def parse_args(argv: list[str] | None = None) -> SoakOptions:
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="python -m example_services.soak",
        description="Chaos soak of the example services on the 3-broker cluster. Needs "
        'OUTBOX_KAFKA_NODES=3 eval "$(bash scripts/services.sh up)". Exit 0 only if every '
        "invariant holds and every fault kind was injected.",
    )
    parser.add_argument("--duration-s", type=float, default=float(env.get("SOAK_S", 1800)))
    seed = env.get("SOAK_SEED")
    parser.add_argument("--seed", type=int, default=int(seed) if seed else None)
    parser.add_argument("--rate", type=float, default=float(env.get("SOAK_RATE", 20)))
    parser.add_argument("--customers", type=int, default=40)
    parser.add_argument("--liveness-bound-s", type=float, default=60.0)
    parser.add_argument("--kinds", type=_kinds, default=KIND_NAMES, help="fault kinds (all)")
    parser.add_argument("--results-dir", type=Path, default=Path("soak-results"))
    parser.add_argument(
        "--cleanup", choices=("always", "on-success", "never"), default="on-success"
    )
    parser.add_argument("--run-id", default=None)
    args = parser.parse_args(argv)
    shortest = minimum_duration_s()
    if args.kinds == KIND_NAMES and args.duration_s < shortest:
        parser.error(f"--duration-s {args.duration_s:g}: every fault kind needs >= {shortest:g} s")
    return SoakOptions(
        duration_s=args.duration_s,
        seed=args.seed,
        rate_per_s=args.rate,
        customers=args.customers,
        liveness_bound_s=args.liveness_bound_s,
        kinds=args.kinds,
        results_dir=args.results_dir,
        cleanup=args.cleanup,
        run_id=args.run_id,
        plant_bug=env.get(PLANT_BUG_ENV) or None,
    )


async def _run(opts: SoakOptions) -> int:
    # SIGTERM (like Ctrl-C) cancels the soak: its cleanup runs (processes stopped, services
    # and links restored) before the exit.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await run_soak(opts)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    # The observer's own clients retry through every broker fault: their logs are noise here
    # (the daemons' logs, in the results directory, keep theirs).
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        return asyncio.run(_run(opts))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("soak: interrupted; everything it started was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
