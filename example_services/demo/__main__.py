"""``python -m example_services.demo``: see ``--help``."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from example_services.demo._run import FAULTS, PLANT_BUG_ENV, DemoOptions, run_demo


def _faults(value: str) -> tuple[str, ...]:
    chosen = tuple(f.strip() for f in value.split(",") if f.strip())
    unknown = sorted(set(chosen) - set(FAULTS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fault(s) {unknown}; choose from {FAULTS}")
    return chosen


def parse_args(argv: list[str] | None = None) -> DemoOptions:
    """Options from the command line (``LEDGERBOX_DEMO_PLANT_BUG`` from the environment)."""
    parser = argparse.ArgumentParser(
        prog="python -m example_services.demo",
        description="End-to-end demo of ledgerbox: order + payment services under faults. "
        "Needs DATABASE_URL, KAFKA_BOOTSTRAP_SERVERS and REDIS_URL "
        '(eval "$(bash scripts/services.sh up)"). Exit code 0 only if every invariant holds.',
    )
    parser.add_argument("--orders", type=int, default=2000, help="orders to place (2000)")
    parser.add_argument("--customers", type=int, default=20, help="customers (20)")
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent clients (32)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (random)")
    parser.add_argument(
        "--duration-s", type=float, default=None, help="stop sending new orders after this"
    )
    parser.add_argument(
        "--faults",
        type=_faults,
        default=FAULTS,
        help=f"comma-separated subset of {','.join(FAULTS)} (all; kafka and postgres: one "
        "restart of each through scripts/services.sh)",
    )
    parser.add_argument("--no-faults", action="store_true", help="inject no fault")
    parser.add_argument(
        "--retry-fraction", type=float, default=0.05, help="POSTs sent again with the same key"
    )
    parser.add_argument(
        "--drain-timeout-s", type=float, default=300.0, help="deadline to drain (300)"
    )
    parser.add_argument("--redis-outage-s", type=float, default=10.0, help="Redis outage (10)")
    parser.add_argument("--partitions", type=int, default=6, help="partitions per topic (6)")
    parser.add_argument(
        "--results-dir", type=Path, default=Path("demo-results"), help="logs and summary.json"
    )
    parser.add_argument(
        "--cleanup",
        choices=("always", "on-success", "never"),
        default="on-success",
        help="drop the run's databases and topics afterwards (on-success: kept for a look "
        "when the run failed)",
    )
    parser.add_argument("--run-id", default=None, help="names databases/topics/groups (random)")
    args = parser.parse_args(argv)
    return DemoOptions(
        orders=args.orders,
        customers=args.customers,
        concurrency=args.concurrency,
        seed=args.seed,
        duration_s=args.duration_s,
        faults=() if args.no_faults else args.faults,
        retry_fraction=args.retry_fraction,
        drain_timeout_s=args.drain_timeout_s,
        results_dir=args.results_dir,
        cleanup=args.cleanup,
        run_id=args.run_id,
        partitions=args.partitions,
        redis_outage_s=args.redis_outage_s,
        plant_bug=os.environ.get(PLANT_BUG_ENV) or None,
    )


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run_demo(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
