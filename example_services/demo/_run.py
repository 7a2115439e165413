"""The demo's orchestration: databases, topics, processes, load, faults, drain, checks."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.engine import make_url

from example_services._client import HttpPool
from example_services._config import drop_database, prepare_database, url_with_database
from example_services._serve import api_command
from example_services.demo import checker
from example_services.demo._drain import DrainState, count, wait_drained
from example_services.demo._kafka import create_topics, delete_topics, end_offsets, resend_records
from example_services.demo._load import (
    LoadStats,
    Progress,
    customer_ids,
    place_orders,
    plan_balances,
    plan_orders,
    top_up,
)
from example_services.demo._procs import ManagedProcess, free_port
from example_services.demo._scrape import CounterScraper, scrape_loop
from example_services.orders._models import metadata as order_metadata
from example_services.payments._models import metadata as payment_metadata

__all__ = ["FAULTS", "DemoOptions", "run_demo"]

FAULTS = ("relay", "consumer", "redis", "duplicates", "kafka", "postgres")
PLANT_BUG_ENV = "LEDGERBOX_DEMO_PLANT_BUG"
PLANTED_BUGS = ("skip-inbox",)
REPO_ROOT = Path(__file__).resolve().parents[2]

_COUNT_ORDER_EVENTS = "SELECT count(*) FROM outbox WHERE event_type = 'OrderPlaced'"
_COUNT_PAYMENT_EVENTS = "SELECT count(*) FROM outbox WHERE event_type LIKE 'Payment%'"

EXIT_OK = 0
EXIT_INVARIANT = 1
EXIT_INCOMPLETE = 2


@dataclass
class DemoOptions:
    """Command-line options of the demo (see ``__main__``)."""

    orders: int = 2000
    customers: int = 20
    concurrency: int = 32
    seed: int | None = None
    duration_s: float | None = None
    faults: tuple[str, ...] = FAULTS
    retry_fraction: float = 0.05
    drain_timeout_s: float = 300.0
    results_dir: Path = Path("demo-results")
    cleanup: str = "on-success"
    run_id: str | None = None
    partitions: int = 6
    redis_outage_s: float = 10.0
    services_script: Path = REPO_ROOT / "scripts" / "services.sh"
    plant_bug: str | None = None


@dataclass
class _Env:
    database_url: str
    kafka: str
    redis_url: str


@dataclass
class _Run:
    opts: DemoOptions
    env: _Env
    run_id: str
    seed: int
    order_db: str
    payment_db: str
    orders_topic: str
    payments_topic: str
    order_group: str
    payment_group: str
    out: Path
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    redis_down: bool = False
    inbox_duplicates: dict[str, dict[str, int]] = field(default_factory=dict)
    background: list[asyncio.Task[None]] = field(default_factory=list)

    def elapsed_s(self) -> float:
        return round(time.monotonic() - self.started, 1)

    def log(self, message: str) -> None:
        print(f"[demo {time.monotonic() - self.started:7.1f}s] {message}", flush=True)


def _read_env() -> _Env:
    missing = [
        name
        for name in ("DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL")
        if not os.environ.get(name)
    ]
    if missing:
        raise SystemExit(
            f"demo: {', '.join(missing)} not set. Start the services first: "
            'eval "$(bash scripts/services.sh up)"  (or use `make demo`)'
        )
    return _Env(
        os.environ["DATABASE_URL"], os.environ["KAFKA_BOOTSTRAP_SERVERS"], os.environ["REDIS_URL"]
    )


def _child_env(run: _Run, database_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",
        DATABASE_URL=database_url,
        ORDER_DATABASE_URL=run.order_db,
        PAYMENT_DATABASE_URL=run.payment_db,
        KAFKA_BOOTSTRAP_SERVERS=run.env.kafka,
        REDIS_URL=run.env.redis_url,
        ORDERS_TOPIC=run.orders_topic,
        PAYMENTS_TOPIC=run.payments_topic,
        ORDER_CONSUMER_GROUP=run.order_group,
        PAYMENT_CONSUMER_GROUP=run.payment_group,
        MIGRATE_ON_START="false",
    )
    env.pop(PLANT_BUG_ENV, None)
    return env


def _define_processes(run: _Run) -> None:
    py = sys.executable
    logs = run.out / "logs"
    for service, db, api in (
        ("order", run.order_db, "example_services.orders.api:create_app"),
        ("payment", run.payment_db, "example_services.payments.api:create_app"),
    ):
        env = _child_env(run, db)
        port = run.ports[service] = free_port()
        metrics_port = run.ports[f"{service}-consumer-metrics"] = free_port()
        specs: dict[str, list[str]] = {
            f"{service}-api": api_command(api, port, python=py),
            f"{service}-relay": [py, "-m", "ledgerbox.relay", "run"],
            f"{service}-consumer": [
                *(py, "-m", "ledgerbox.inbox", "run", "--app"),
                f"example_services.{service}s.consumer:consumer",
                *("--metrics-port", str(metrics_port)),
            ],
        }
        if service == "payment" and run.opts.plant_bug == "skip-inbox":
            specs["payment-consumer"] = [py, "-m", "example_services.payments.unsafe_consumer"]
        for name, argv in specs.items():
            run.procs[name] = ManagedProcess(name, argv, env, logs / f"{name}.log")


async def _wait_healthy(run: _Run, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        for service in ("order", "payment"):
            url = f"http://127.0.0.1:{run.ports[service]}/health"
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url)).status_code == 200:
                        break
                proc = run.procs[f"{service}-api"]
                if not proc.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"{service}-api did not become healthy:\n{proc.tail()}")
                await asyncio.sleep(0.2)


async def _monitor(run: _Run, stop: asyncio.Event) -> None:
    """Restart any process that exited on its own (recorded: it fails the run)."""
    while not stop.is_set():
        for proc in run.procs.values():
            code = proc.check()
            if code is not None:
                run.log(f"!! {proc.name} exited on its own with code {code}; restarting")
                proc.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.5)


async def _services_script(run: _Run, command: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "bash",
        str(run.opts.services_script),
        command,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"services.sh {command} failed: {err.decode(errors='replace')}")


def _start_redis_blocking(run: _Run) -> None:
    # Blocking on purpose: this must run even while the event loop is being cancelled.
    subprocess.run(["bash", str(run.opts.services_script), "start-redis"], check=False)
    run.redis_down = False


async def _inject(run: _Run, kind: str, rng: random.Random) -> None:
    try:
        await _inject_one(run, kind, rng)
    except Exception as exc:  # a fault that could not be injected is reported, not fatal
        run.log(f"!! fault {kind} could not be injected: {exc!r}")
        run.faults.append({"fault": kind, "error": repr(exc), "at_s": run.elapsed_s()})


async def _inject_one(run: _Run, kind: str, rng: random.Random) -> None:
    at_s = run.elapsed_s()
    if kind in ("relay", "consumer"):
        target = rng.choice([f"order-{kind}", f"payment-{kind}"])
        down_s = round(rng.uniform(0.5, 2.0), 1)
        run.log(f"fault: kill -9 {target}, restart in {down_s} s")
        run.procs[target].kill9()
        await asyncio.sleep(down_s)
        run.procs[target].start()
        run.faults.append({"fault": f"kill -9 {kind}", "target": target, "at_s": at_s})
    elif kind == "redis":
        run.log(f"fault: Redis stopped for {run.opts.redis_outage_s:g} s")
        run.redis_down = True
        try:
            await _services_script(run, "stop-redis")
            await asyncio.sleep(run.opts.redis_outage_s)
        finally:
            _start_redis_blocking(run)
        run.log("fault: Redis started again")
        run.faults.append(
            {"fault": "redis outage", "duration_s": run.opts.redis_outage_s, "at_s": at_s}
        )
    elif kind in ("kafka", "postgres"):
        # A restart of the broker (all of it: one node) or of the database server, once: every
        # daemon loses its connections and must reconnect; nothing may be lost or doubled.
        down_s = round(rng.uniform(1.0, 3.0), 1)
        run.log(f"fault: {kind} restart (stopped for {down_s} s)")
        started = time.monotonic()
        try:
            await _services_script(run, f"stop-{kind}")
            await asyncio.sleep(down_s)
        finally:
            await _services_script(run, f"start-{kind}")
        took = round(time.monotonic() - started, 1)
        run.log(f"fault: {kind} is back after {took} s")
        run.faults.append({"fault": f"{kind} restart", "down_s": took, "at_s": at_s})
    elif kind == "duplicates":
        per_topic = max(10, run.opts.orders // 10)
        sent = {
            topic: await resend_records(run.env.kafka, topic, per_topic, rng)
            for topic in (run.orders_topic, run.payments_topic)
        }
        run.log(f"fault: duplicate deliveries re-sent {sent}")
        run.faults.append({"fault": "duplicate deliveries", "records": sent, "at_s": at_s})


async def _faults(run: _Run, progress: Progress, rng: random.Random) -> None:
    windows = {"relay": (0.15, 0.5), "consumer": (0.2, 0.6), "redis": (0.1, 0.4)}
    windows["duplicates"] = (0.5, 0.8)
    windows["kafka"] = (0.3, 0.45)
    windows["postgres"] = (0.6, 0.75)
    plan = sorted((rng.uniform(*windows[kind]), kind) for kind in run.opts.faults)
    tasks = []
    for at, kind in plan:
        await progress.reached(at)
        tasks.append(asyncio.create_task(_inject(run, kind, rng)))
    await asyncio.gather(*tasks)


async def _mid_run_topups(
    run: _Run, payments: HttpPool, progress: Progress, stats: LoadStats, rng: random.Random
) -> None:
    """Top-ups while orders are being paid: they race the consumer on the wallet version."""
    await progress.reached(0.5)
    chosen = rng.sample(customer_ids(run.opts.customers), max(1, run.opts.customers // 4))
    amount = Decimal("50.00")
    await asyncio.gather(
        *(top_up(payments, c, amount, f"{run.run_id}-mid-{c}", stats, replay=True) for c in chosen)
    )


async def _kafka_duplicates(run: _Run) -> dict[str, int]:
    """Records on each topic beyond its unique events: duplicate deliveries the consumer got."""
    result = {}
    for topic, db, query in (
        (run.orders_topic, run.order_db, _COUNT_ORDER_EVENTS),
        (run.payments_topic, run.payment_db, _COUNT_PAYMENT_EVENTS),
    ):
        records = sum((await end_offsets(run.env.kafka, [topic])).values())
        unique = await asyncio.to_thread(count, db, query)
        result[topic] = records - unique
    return result


def _summary(
    run: _Run,
    snapshot: checker.Snapshot,
    results: list[checker.InvariantResult],
    stats: LoadStats,
    drain: DrainState,
    duplicates: Mapping[str, int],
    load_s: float,
    total_s: float,
) -> dict[str, Any]:
    statuses = [o.status for o in snapshot.orders]
    lat = checker.latencies_ms(snapshot.orders)
    created = len(snapshot.orders)
    failed = [r.name for r in results if not r.ok]
    http = {k: v for k, v in asdict(stats).items() if k != "requests"}
    return {
        "ok": not failed and drain.drained,
        "run_id": run.run_id,
        "seed": run.seed,
        "finished_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(run.opts).items()},
        "orders": {
            "planned": run.opts.orders,
            "created": created,
            "paid": statuses.count("PAID"),
            "cancelled": statuses.count("CANCELLED"),
            "pending": statuses.count("PENDING"),
        },
        "payments": {
            "succeeded": sum(p.status == "SUCCEEDED" for p in snapshot.payments),
            "failed": sum(p.status == "FAILED" for p in snapshot.payments),
        },
        "http": http,
        "duplicates": {
            "http_retries_answered_with_first_order": stats.replayed_200,
            "topup_retries_answered_with_first": stats.topup_replays,
            "kafka_duplicate_records_delivered": dict(duplicates),
            "inbox_suppressed_by_path": run.inbox_duplicates,
            "note": (
                "kafka_duplicate_records_delivered: records on each topic beyond its unique "
                "events (relay re-publish after kill -9, re-sent records), all consumed (lag "
                "0); inbox_suppressed_by_path: the consumers' ledgerbox_inbox_duplicates_total "
                "by path (redis fast path / db inbox), scraped every second, a lower bound "
                "(increments just before a kill -9 are lost); redeliveries after a consumer "
                "kill come on top of the Kafka count"
            ),
        },
        "faults": run.faults,
        "processes": {
            name: {"kills": p.kills, "restarts": p.restarts, "crashes": p.unexpected_exits}
            for name, p in run.procs.items()
        },
        "throughput": {
            "load_s": round(load_s, 2),
            "orders_per_s_during_load": round(created / load_s, 1) if load_s else None,
            "end_to_end_s": round(total_s, 2),
            "orders_per_s_end_to_end": round(created / total_s, 1) if total_s else None,
        },
        "latency_ms": {
            "what": "order created_at (placing tx) -> closed_at (order consumer tx), DB clock",
            "count": len(lat),
            "p50": _round(checker.percentile(lat, 50)),
            "p99": _round(checker.percentile(lat, 99)),
            "max": _round(lat[-1] if lat else None),
        },
        "drain": drain.as_dict(),
        "invariants": [r.as_dict() for r in results],
        "failed_invariants": failed,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _print_summary(summary: Mapping[str, Any]) -> None:
    o, t, lat = summary["orders"], summary["throughput"], summary["latency_ms"]
    d = summary["duplicates"]
    lines = [
        "",
        "=" * 78,
        f"ledgerbox demo {summary['run_id']} (seed {summary['seed']}): "
        + ("ALL INVARIANTS HOLD" if summary["ok"] else "FAILED"),
        "=" * 78,
        f"orders     created {o['created']} / planned {o['planned']}: paid {o['paid']}, "
        f"cancelled {o['cancelled']}, pending {o['pending']}",
        f"payments   succeeded {summary['payments']['succeeded']}, "
        f"failed {summary['payments']['failed']}",
        f"duplicates HTTP retries answered with the first order: "
        f"{d['http_retries_answered_with_first_order']}; top-up retries: "
        f"{d['topup_retries_answered_with_first']}",
        f"           duplicate Kafka records delivered: {d['kafka_duplicate_records_delivered']}",
        f"           suppressed by the consumers (by path): {d['inbox_suppressed_by_path']}",
        f"faults     {len(summary['faults'])}: "
        + "; ".join(
            f"{f['fault']}{' ' + f['target'] if 'target' in f else ''} @ {f['at_s']} s"
            for f in summary["faults"]
        ),
        f"throughput {t['orders_per_s_during_load']} orders/s during load ({t['load_s']} s), "
        f"{t['orders_per_s_end_to_end']} orders/s end to end ({t['end_to_end_s']} s)",
        f"latency    commit -> applied (2 hops): p50 {lat['p50']} ms, p99 {lat['p99']} ms, "
        f"max {lat['max']} ms",
        f"drain      drained={summary['drain']['drained']} after {summary['drain']['waited_s']} s",
        "invariants:",
    ]
    for inv in summary["invariants"]:
        mark = "ok  " if inv["ok"] else "FAIL"
        lines.append(f"  [{mark}] {inv['name']:<28} checked {inv['checked']:>6}")
        if not inv["ok"]:
            lines.append(f"         {inv['violations']} violation(s), e.g.:")
            lines.extend(f"           - {example}" for example in inv["examples"][:5])
    print("\n".join(lines), flush=True)


async def _cleanup(run: _Run, keep: bool) -> None:
    for proc in run.procs.values():
        await asyncio.to_thread(proc.stop)
    if run.redis_down:
        _start_redis_blocking(run)
    if keep:
        names = [make_url(u).database for u in (run.order_db, run.payment_db)]
        run.log(f"kept databases {names}, topics {run.orders_topic}, {run.payments_topic}")
        return
    with contextlib.suppress(Exception):
        await delete_topics(
            run.env.kafka,
            [
                run.orders_topic,
                run.payments_topic,
                f"{run.orders_topic}.dlq",
                f"{run.payments_topic}.dlq",
            ],
        )
    for url in (run.order_db, run.payment_db):
        with contextlib.suppress(Exception):
            await asyncio.to_thread(drop_database, url)


async def run_demo(opts: DemoOptions) -> int:
    """Run the whole demo; returns the process exit code (0: every invariant holds)."""
    env = _read_env()
    if opts.plant_bug is not None and opts.plant_bug not in PLANTED_BUGS:
        raise SystemExit(f"demo: {PLANT_BUG_ENV} must be one of {PLANTED_BUGS}")
    run_id = opts.run_id or secrets.token_hex(3)
    seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(2**31)
    prefix = f"ledgerbox-demo-{run_id}"
    run = _Run(
        opts=opts,
        env=env,
        run_id=run_id,
        seed=seed,
        order_db=url_with_database(env.database_url, f"demo_{run_id}_orders"),
        payment_db=url_with_database(env.database_url, f"demo_{run_id}_payments"),
        orders_topic=f"{prefix}.orders.events",
        payments_topic=f"{prefix}.payments.events",
        order_group=f"order-service.{run_id}",
        payment_group=f"payment-service.{run_id}",
        out=opts.results_dir,
    )
    run.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    run.log(f"run {run_id}, seed {seed}, results in {run.out}/")
    if opts.plant_bug:
        run.log(f"PLANTED BUG: {opts.plant_bug} (the checker must catch it)")
    ok = False
    try:
        await asyncio.to_thread(prepare_database, run.order_db, order_metadata)
        await asyncio.to_thread(prepare_database, run.payment_db, payment_metadata)
        await create_topics(env.kafka, [run.orders_topic, run.payments_topic], opts.partitions)
        run.log("databases migrated, topics created; starting 6 processes")
        _define_processes(run)
        for proc in run.procs.values():
            proc.start()
        await _wait_healthy(run)
        stop_monitor = asyncio.Event()
        monitor = asyncio.create_task(_monitor(run, stop_monitor))
        run.background.append(monitor)
        scrapers = {
            service: CounterScraper(
                f"http://127.0.0.1:{run.ports[f'{service}-consumer-metrics']}/metrics",
                "ledgerbox_inbox_duplicates_total",
                "path",
            )
            for service in ("order", "payment")
        }
        scraping = asyncio.create_task(scrape_loop(list(scrapers.values()), stop_monitor))
        run.background.append(scraping)

        customers = customer_ids(opts.customers)
        plans = plan_orders(rng, opts.orders, customers, opts.retry_fraction)
        balances = plan_balances(rng, plans, customers)
        stats = LoadStats()
        progress = Progress(total=len(plans))
        orders_api = HttpPool(run.ports["order"], size=opts.concurrency + 8, timeout_s=30.0)
        payments_api = HttpPool(run.ports["payment"], size=32, timeout_s=30.0)
        try:
            await asyncio.gather(
                *(
                    top_up(payments_api, c, amount, f"{run_id}-seed-{c}", stats, replay=i < 3)
                    for i, (c, amount) in enumerate(balances.items())
                )
            )
            run.log(
                f"seeded {len(balances)} wallets; sending {len(plans)} orders "
                f"(concurrency {opts.concurrency}, faults: {', '.join(opts.faults) or 'none'})"
            )
            load_started = time.monotonic()
            load = asyncio.create_task(
                place_orders(
                    orders_api,
                    plans,
                    concurrency=opts.concurrency,
                    progress=progress,
                    stats=stats,
                    duration_s=opts.duration_s,
                )
            )
            await asyncio.gather(
                load,
                _faults(run, progress, rng),
                _mid_run_topups(run, payments_api, progress, stats, rng),
            )
        finally:
            orders_api.close()
            payments_api.close()
        load_s = stats.elapsed_s
        run.log(
            f"load done in {load_s:.1f} s ({stats.posts} POSTs); waiting for the pipeline to drain"
        )
        drain = await wait_drained(
            env.kafka,
            {"order": run.order_db, "payment": run.payment_db},
            [(run.payment_group, [run.orders_topic]), (run.order_group, [run.payments_topic])],
            run.order_db,
            timeout_s=opts.drain_timeout_s,
        )
        total_s = time.monotonic() - load_started
        stop_monitor.set()
        await asyncio.gather(monitor, scraping)
        run.inbox_duplicates = {f"{s}-consumer": c.totals() for s, c in scrapers.items()}
        run.log(f"drained={drain.drained} after {drain.waited_s:.1f} s; checking invariants")

        snapshot = await asyncio.to_thread(checker.read_snapshot, run.order_db, run.payment_db)
        results = checker.check_all(snapshot, stats.requests)
        crashes = checker.InvariantResult("no_process_crashed", len(run.procs))
        for proc in run.procs.values():
            for code in proc.unexpected_exits:
                crashes.fail(f"{proc.name} exited on its own with code {code}")
        results.append(crashes)
        duplicates = await _kafka_duplicates(run)
        summary = _summary(run, snapshot, results, stats, drain, duplicates, load_s, total_s)
        (run.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        _print_summary(summary)
        ok = bool(summary["ok"])
        if summary["failed_invariants"]:
            return EXIT_INVARIANT
        return EXIT_OK if ok else EXIT_INCOMPLETE
    except Exception as exc:  # infrastructure failure: report it in the summary, exit 2
        run.log(f"!! demo aborted: {exc!r}")
        failure = {
            "ok": False,
            "run_id": run.run_id,
            "seed": run.seed,
            "error": repr(exc),
            "faults": run.faults,
            "processes": {
                name: {"kills": p.kills, "restarts": p.restarts, "crashes": p.unexpected_exits}
                for name, p in run.procs.items()
            },
            "failed_invariants": [],
        }
        (run.out / "summary.json").write_text(json.dumps(failure, indent=2, default=str) + "\n")
        return EXIT_INCOMPLETE
    finally:
        for task in run.background:
            task.cancel()
        keep = opts.cleanup == "never" or (opts.cleanup == "on-success" and not ok)
        await _cleanup(run, keep=keep)
