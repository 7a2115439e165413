"""The soak's orchestration: cluster check, proxy, databases, topics, processes, load, faults,
drain, invariants, report, cleanup.

Topology (every daemon's traffic goes through the fault proxy; the observer's does not)::

    load (HTTP) -> order-api, payment-api --------------------------> PostgreSQL (direct)
    {order,payment}-relay-{1,2}, -consumer-{1,2} -> proxy -> PostgreSQL, Redis, Kafka x3
    soak observer (samples, lag, read-back, checks) ----------------> PostgreSQL, Kafka (direct)

The APIs talk to PostgreSQL directly: the HTTP load is what drives the system, the daemons
are what the network faults attack; PostgreSQL restarts and killed backends hit the APIs too.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import secrets
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from example_services._config import drop_database, prepare_database, url_with_database
from example_services._serve import api_command
from example_services.demo import checker
from example_services.demo._drain import wait_drained
from example_services.demo._kafka import create_topics, delete_topics
from example_services.demo._procs import ManagedProcess
from example_services.orders._models import metadata as order_metadata
from example_services.payments._models import metadata as payment_metadata
from example_services.soak import invariants as inv
from example_services.soak.faults import Injector, ServicesScript
from example_services.soak.load import OrderLoad
from example_services.soak.monitor import Monitor
from example_services.soak.proxy import ProxyControl
from example_services.soak.report import buckets, per_kind, plot, print_summary
from example_services.soak.schedule import KIND_NAMES, PlannedFault, plan_faults

__all__ = ["PLANTED_BUGS", "SoakOptions", "run_soak"]

PLANT_BUG_ENV = "LEDGERBOX_SOAK_PLANT_BUG"
PLANTED_BUGS = ("skip-inbox", "ack-before-commit")
REPO_ROOT = Path(__file__).resolve().parents[2]
EXIT_OK, EXIT_INVARIANT, EXIT_INCOMPLETE = 0, 1, 2


@dataclass
class SoakOptions:
    """Options of one soak (``python -m example_services.soak --help``)."""

    duration_s: float = 1800.0
    seed: int | None = None
    rate_per_s: float = 20.0
    customers: int = 40
    partitions: int = 6
    liveness_bound_s: float = 60.0
    kinds: tuple[str, ...] = KIND_NAMES
    results_dir: Path = Path("soak-results")
    cleanup: str = "on-success"
    plant_bug: str | None = None
    run_id: str | None = None
    services_script: Path = REPO_ROOT / "scripts" / "services.sh"


@dataclass
class _Env:
    database_url: str
    kafka_direct: str
    kafka_proxied: str
    kafka_links: list[str]
    redis_url: str
    port_base: int


def _read_env() -> _Env:
    missing = [
        name
        for name in (
            "DATABASE_URL",
            "KAFKA_BOOTSTRAP_SERVERS",
            "KAFKA_PROXIED_BOOTSTRAP_SERVERS",
            "OUTBOX_KAFKA_PROXY_LINKS",
            "REDIS_URL",
        )
        if not os.environ.get(name)
    ]
    if missing:
        raise SystemExit(
            f"soak: {', '.join(missing)} not set. The soak needs the 3-broker cluster: "
            'OUTBOX_KAFKA_NODES=3 eval "$(bash scripts/services.sh up)" (or use `make soak`)'
        )
    return _Env(
        os.environ["DATABASE_URL"],
        os.environ["KAFKA_BOOTSTRAP_SERVERS"],
        os.environ["KAFKA_PROXIED_BOOTSTRAP_SERVERS"],
        os.environ["OUTBOX_KAFKA_PROXY_LINKS"].split(","),
        os.environ["REDIS_URL"],
        int(os.environ.get("OUTBOX_KAFKA_CLUSTER_PORT", "9400")),
    )


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@dataclass
class _Soak:
    opts: SoakOptions
    env: _Env
    run_id: str
    seed: int
    out: Path
    order_db: str = ""
    payment_db: str = ""
    orders_topic: str = ""
    payments_topic: str = ""
    order_group: str = ""
    payment_group: str = ""
    proxy_ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    t0_monotonic: float = field(default_factory=time.monotonic)
    t0_wall: float = field(default_factory=time.time)
    created_resources: bool = False
    exits: list[dict[str, Any]] = field(default_factory=list)

    def log(self, message: str) -> None:
        print(f"[soak {time.monotonic() - self.t0_monotonic:7.1f}s] {message}", flush=True)

    def proxied_db(self, url: str) -> str:
        return make_url(url).set(port=self.proxy_ports["pg"]).render_as_string(hide_password=False)

    def proxied_redis(self) -> str:
        redis = self.env.redis_url.replace("redis://", "", 1)
        host_port, _, rest = redis.partition("/")
        host = host_port.rsplit(":", 1)[0]
        return f"redis://{host}:{self.proxy_ports['redis']}/{rest}"


class _Lag:
    """Consumer lag of both groups from the brokers' own listener (clients made per call:
    aiokafka clients pinned to a killed broker do not recover reliably)."""

    def __init__(self, soak: _Soak) -> None:
        self.soak = soak

    async def __call__(self) -> tuple[int, int]:
        from example_services.demo._kafka import consumer_lag

        s = self.soak
        return (
            await consumer_lag(s.env.kafka_direct, s.payment_group, [s.orders_topic]),
            await consumer_lag(s.env.kafka_direct, s.order_group, [s.payments_topic]),
        )


def _define_processes(s: _Soak) -> None:
    py = sys.executable
    logs = s.out / "logs"
    base = dict(os.environ)
    base.pop(PLANT_BUG_ENV, None)
    for key in ("KAFKA_PROXIED_BOOTSTRAP_SERVERS", "OUTBOX_KAFKA_PROXY_LINKS"):
        base.pop(key, None)
    common = {
        "PYTHONUNBUFFERED": "1",
        "ORDERS_TOPIC": s.orders_topic,
        "PAYMENTS_TOPIC": s.payments_topic,
        "ORDER_CONSUMER_GROUP": s.order_group,
        "PAYMENT_CONSUMER_GROUP": s.payment_group,
        "MIGRATE_ON_START": "false",
    }
    direct = {**common, "ORDER_DATABASE_URL": s.order_db, "PAYMENT_DATABASE_URL": s.payment_db}
    proxied = {
        **common,
        "ORDER_DATABASE_URL": s.proxied_db(s.order_db),
        "PAYMENT_DATABASE_URL": s.proxied_db(s.payment_db),
        "KAFKA_BOOTSTRAP_SERVERS": s.env.kafka_proxied,
        "REDIS_URL": s.proxied_redis(),
    }
    control = s.proxy_ports["control"]
    links = [*s.env.kafka_links]
    links.append(f"pg={s.proxy_ports['pg']}:{make_url(s.env.database_url).port}")
    redis_port = int(s.env.redis_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    links.append(f"redis={s.proxy_ports['redis']}:{redis_port}")
    s.procs["proxy"] = ManagedProcess(
        "proxy",
        [
            *(py, "-m", "example_services.soak.proxy", "serve", "--control-port", str(control)),
            *(arg for link in links for arg in ("--link", link)),
        ],
        {**base, **common},
        logs / "proxy.log",
    )
    for service, db in (("order", s.order_db), ("payment", s.payment_db)):
        port = s.proxy_ports[f"{service}-api"]
        s.procs[f"{service}-api"] = ManagedProcess(
            f"{service}-api",
            api_command(f"example_services.{service}s.api:create_app", port, python=py),
            {**base, **direct, "DATABASE_URL": db},
            logs / f"{service}-api.log",
        )
        consumer = [
            *(py, "-m", "ledgerbox.inbox", "run", "--app"),
            f"example_services.{service}s.consumer:consumer",
        ]
        if service == "payment" and s.opts.plant_bug == "skip-inbox":
            consumer = [py, "-m", "example_services.payments.unsafe_consumer"]
        if service == "payment" and s.opts.plant_bug == "ack-before-commit":
            consumer = [py, "-m", "example_services.soak._planted"]
        for i in (1, 2):
            s.procs[f"{service}-relay-{i}"] = ManagedProcess(
                f"{service}-relay-{i}",
                [py, "-m", "ledgerbox.relay", "run", "--relay-id", f"{service}-relay-{i}"],
                {**base, **proxied, "DATABASE_URL": s.proxied_db(db)},
                logs / f"{service}-relay-{i}.log",
            )
            s.procs[f"{service}-consumer-{i}"] = ManagedProcess(
                f"{service}-consumer-{i}",
                consumer,
                {**base, **proxied, "DATABASE_URL": s.proxied_db(db)},
                logs / f"{service}-consumer-{i}.log",
            )


async def _wait_healthy(s: _Soak, timeout_s: float = 120.0) -> None:
    from example_services.soak.load import HttpError, HttpPool

    deadline = time.monotonic() + timeout_s
    for name in ("order-api", "payment-api"):
        pool = HttpPool(s.proxy_ports[name], 1, timeout_s=2.0)
        try:
            while True:
                with contextlib.suppress(HttpError):
                    if (await pool.request("GET", "/health"))[0] == 200:
                        break
                if not s.procs[name].alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not become healthy:\n{s.procs[name].tail()}")
                await asyncio.sleep(0.3)
        finally:
            pool.close()
    ctl = ProxyControl(s.proxy_ports["control"])
    while True:
        try:
            await ctl.status()
            return
        except OSError:
            if not s.procs["proxy"].alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"fault proxy did not start:\n{s.procs['proxy'].tail()}"
                ) from None
            await asyncio.sleep(0.2)


#: A daemon that exits sooner than this after it was started failed to start (typically: a
#: dependency was down when it came up); later, it crashed while running.
STARTUP_S = 30.0
#: Most seconds a planned fault may start after SOAK_S (the load is extended meanwhile).
GRACE_S = 120.0


async def _watchdog(s: _Soak, stop: asyncio.Event, active: Callable[[], list[str]]) -> None:
    """Restart a process that exited on its own, as a supervisor would; each exit is recorded
    (``no_process_crashed`` / ``daemons_survive_startup_outage``)."""
    while not stop.is_set():
        for proc in s.procs.values():
            code = proc.check()
            if code is not None:
                uptime = proc.exit_uptimes_s[-1]
                faults = active()
                s.exits.append(
                    {
                        "process": proc.name,
                        "code": code,
                        "uptime_s": uptime,
                        "at_s": round(time.monotonic() - s.t0_monotonic, 1),
                        "active_faults": faults,
                        "log_tail": proc.tail(40),
                    }
                )
                s.log(
                    f"!! {proc.name} exited on its own with code {code} {uptime:.1f} s after its "
                    f"start (faults active: {','.join(faults) or 'none'}); restarting"
                )
                proc.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def _final_checks(
    s: _Soak, load: OrderLoad, injector: Injector
) -> tuple[list[checker.InvariantResult], dict[str, Any], checker.Snapshot]:
    snapshot = await asyncio.to_thread(checker.read_snapshot, s.order_db, s.payment_db)
    results = checker.check_all(snapshot, load.stats.requests)
    order_outbox = await asyncio.to_thread(inv.read_outbox, s.order_db)
    payment_outbox = await asyncio.to_thread(inv.read_outbox, s.payment_db)
    effects = await asyncio.to_thread(inv.read_payment_effects, s.payment_db)
    applied = await asyncio.to_thread(inv.read_applied_event_ids, s.order_db)
    orders_read = await inv.read_topic(s.env.kafka_direct, s.orders_topic)
    payments_read = await inv.read_topic(s.env.kafka_direct, s.payments_topic)
    timings = {
        t.order_id: inv.Timing(t.order_id, t.sent, t.acked)
        for t in load.stats.timings.values()
        if t.order_id is not None and t.acked is not None
    }
    spans = [
        inv.FaultSpan(r.index, r.kind, r.started, r.ended)
        for r in injector.records
        if r.started is not None and r.ended is not None
    ]
    results += [
        inv.check_no_event_lost(
            order_outbox,
            payment_outbox,
            orders_read.records,
            payments_read.records,
            {e.event_id for e in effects},
            set(applied),
        ),
        inv.check_one_effect_per_event(order_outbox, payment_outbox, effects, applied),
        inv.check_kafka_order_matches_commit_order(orders_read.records, timings),
        inv.check_applied_in_kafka_order(orders_read.records, effects),
        inv.check_liveness_after_faults(snapshot.orders, spans, s.opts.liveness_bound_s),
    ]
    crashes = checker.InvariantResult("no_process_crashed", len(s.procs))
    startup = checker.InvariantResult(
        "daemons_survive_startup_outage", sum(p.starts for p in s.procs.values())
    )
    for e in s.exits:
        during = ",".join(e["active_faults"]) or "no fault"
        lines = [ln.strip() for ln in e["log_tail"].splitlines() if ln.strip()]
        errors = [
            ln for ln in lines if "Error" in ln and not ln.startswith(("consumer:", "producer:"))
        ]
        cause = (errors or lines or [""])[-1]
        message = (
            f"{e['process']} exited with code {e['code']} at {e['at_s']} s, {e['uptime_s']} s "
            f"after it started, during {during}: {cause[:200]}"
        )
        (startup if e["uptime_s"] < STARTUP_S else crashes).fail(message)
    results += [crashes, startup]
    kafka = {
        "orders_records": len(orders_read.records),
        "orders_unique": len({r.event_id for r in orders_read.records}),
        "payments_records": len(payments_read.records),
        "payments_unique": len({r.event_id for r in payments_read.records}),
        "unparsable": orders_read.unparsable + payments_read.unparsable,
    }
    return results, kafka, snapshot


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


async def _cleanup(s: _Soak, keep: bool, services: ServicesScript) -> None:
    for proc in s.procs.values():
        proc.resume()
    with contextlib.suppress(Exception):
        await ProxyControl(s.proxy_ports["control"]).clear("*")
    for name, proc in s.procs.items():
        if name != "proxy":
            await asyncio.to_thread(proc.stop)
    if "proxy" in s.procs:
        await asyncio.to_thread(s.procs["proxy"].stop)
    # Whatever a cancelled fault left down comes back (idempotent for what runs).
    for command in ("start-postgres", "start-redis", "start-kafka"):
        with contextlib.suppress(Exception):
            await services(command, timeout_s=240)
    if keep or not s.created_resources:
        if s.created_resources:
            s.log(f"kept databases of run {s.run_id} and topics {s.orders_topic}, ...")
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(
            delete_topics(
                s.env.kafka_direct,
                [
                    s.orders_topic,
                    s.payments_topic,
                    f"{s.orders_topic}.dlq",
                    f"{s.payments_topic}.dlq",
                ],
            ),
            60,
        )
    for url in (s.order_db, s.payment_db):
        with contextlib.suppress(Exception):
            await asyncio.to_thread(drop_database, url)


async def run_soak(opts: SoakOptions) -> int:
    """Run one soak; returns the exit code (0 all invariants hold, 1 one failed, 2 incomplete)."""
    env = _read_env()
    if opts.plant_bug is not None and opts.plant_bug not in PLANTED_BUGS:
        raise SystemExit(f"soak: {PLANT_BUG_ENV} must be one of {PLANTED_BUGS}")
    run_id = opts.run_id or secrets.token_hex(3)
    seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(2**31)
    s = _Soak(opts=opts, env=env, run_id=run_id, seed=seed, out=opts.results_dir)
    prefix = f"ledgerbox-soak-{run_id}"
    s.order_db = url_with_database(env.database_url, f"soak_{run_id}_orders")
    s.payment_db = url_with_database(env.database_url, f"soak_{run_id}_payments")
    s.orders_topic, s.payments_topic = f"{prefix}.orders.events", f"{prefix}.payments.events"
    s.order_group, s.payment_group = f"order-service.{run_id}", f"payment-service.{run_id}"
    b = env.port_base
    s.proxy_ports = {
        "pg": b + 12,
        "redis": b + 13,
        "control": b + 14,
        "order-api": b + 15,
        "payment-api": b + 16,
    }
    s.out.mkdir(parents=True, exist_ok=True)
    plan = plan_faults(seed, opts.duration_s, kinds=opts.kinds)
    replay = f"SOAK_SEED={seed} SOAK_S={opts.duration_s:g} make soak"
    s.log(f"run {run_id}, seed {seed} (replay: {replay}), {len(plan)} faults planned")
    if opts.plant_bug:
        s.log(f"PLANTED BUG: {opts.plant_bug} (the soak must fail and name the invariant)")
    (s.out / "plan.json").write_text(json.dumps([f.as_dict() for f in plan], indent=1) + "\n")
    services = ServicesScript(str(opts.services_script), os.environ)
    rng = random.Random(seed)
    code = EXIT_INCOMPLETE
    ok = False
    load: OrderLoad | None = None
    tasks: list[asyncio.Task[Any]] = []
    monitor: Monitor | None = None
    try:
        await asyncio.to_thread(prepare_database, s.order_db, order_metadata)
        await asyncio.to_thread(prepare_database, s.payment_db, payment_metadata)
        s.created_resources = True
        await create_topics(
            env.kafka_direct, [s.orders_topic, s.payments_topic], opts.partitions, 3
        )
        _define_processes(s)
        for proc in s.procs.values():
            proc.start()
        await _wait_healthy(s)
        s.log(f"{len(s.procs)} processes up; daemons go through the fault proxy")
        stop_all = asyncio.Event()
        active: list[Callable[[], list[str]]] = [list]
        tasks.append(asyncio.create_task(_watchdog(s, stop_all, lambda: active[0]())))
        load = OrderLoad(
            order_port=s.proxy_ports["order-api"],
            payment_port=s.proxy_ports["payment-api"],
            rng=random.Random(rng.randrange(2**31)),
            rate_per_s=opts.rate_per_s,
            customers=opts.customers,
        )
        await load.seed_wallets(20.0)
        injector = Injector(
            procs=s.procs,
            services=services,
            proxy=ProxyControl(s.proxy_ports["control"]),
            admin_dsn=_libpq(url_with_database(env.database_url, "postgres")),
            databases=[make_url(u).database or "" for u in (s.order_db, s.payment_db)],
            redis_url=env.redis_url,
            kafka_direct=env.kafka_direct,
            topics=[s.orders_topic, s.payments_topic],
            seed=seed,
            t0_monotonic=time.monotonic(),
            t0_wall=time.time(),
            log=s.log,
        )
        s.t0_monotonic, s.t0_wall = injector.t0_monotonic, injector.t0_wall
        active[0] = injector.active_kinds
        monitor = Monitor(
            order_dsn=_libpq(s.order_db),
            payment_dsn=_libpq(s.payment_db),
            order_url=s.order_db,
            payment_url=s.payment_db,
            stats=load.stats,
            active_faults=injector.active_kinds,
            faults_done=lambda: sum(1 for r in injector.records if r.ended is not None),
            lag=_Lag(s),
            t0_wall=s.t0_wall,
            log=s.log,
        )
        stop_load, stop_monitor = asyncio.Event(), asyncio.Event()
        monitoring = asyncio.create_task(monitor.run(stop_monitor))
        tasks.append(monitoring)
        loading = asyncio.create_task(load.run(stop_load))
        # A fault still waiting for its resource (the one before it took longer than its
        # estimate) may start up to GRACE_S after SOAK_S; the load runs on until it is over.
        last_start = opts.duration_s + GRACE_S
        faulting = asyncio.create_task(injector.run_plan(plan, deadline_s=last_start))
        tasks += [loading, faulting]
        s.log(f"load {opts.rate_per_s:g} orders/s for {opts.duration_s:g} s; faults start")
        await asyncio.sleep(max(0.0, opts.duration_s - (time.monotonic() - s.t0_monotonic)))
        while not faulting.done() and time.monotonic() - s.t0_monotonic < last_start:
            if not any(r.started is None and r.error is None for r in injector.records):
                break  # only faults in progress: they end by themselves
            await asyncio.wait([faulting], timeout=1.0)
        load_s = round(time.monotonic() - s.t0_monotonic, 1)
        stop_load.set()
        s.log(f"load stops after {load_s:g} s; waiting for faults in progress and requests")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(faulting), 240)
        if not faulting.done():
            faulting.cancel()
            with contextlib.suppress(BaseException):
                await faulting
        await loading
        last_end = max([r.ended for r in injector.records if r.ended] or [time.time()])
        drain_s = max(30.0, last_end + opts.liveness_bound_s + 30.0 - time.time())
        s.log(f"draining (up to {drain_s:.0f} s)")
        drain = await wait_drained(
            env.kafka_direct,
            {"order": s.order_db, "payment": s.payment_db},
            [(s.payment_group, [s.orders_topic]), (s.order_group, [s.payments_topic])],
            s.order_db,
            timeout_s=drain_s,
        )
        stop_monitor.set()
        await monitoring
        stop_all.set()
        s.log(f"drained={drain.drained} after {drain.waited_s:.1f} s; checking invariants")
        results, kafka, snapshot = await _final_checks(s, load, injector)
        recovery = {
            r.index: inv.recovery_s(snapshot.orders, r.ended)
            for r in injector.records
            if r.ended is not None
        }
        report_extra = {"load_s": load_s}
        report = _report(
            s, opts, plan, injector, load, monitor, snapshot, results, kafka, drain, recovery
        )
        report["load"] |= report_extra
        json_path, png_path = s.out / "soak-report.json", s.out / "soak-report.png"
        report["files"] = {"json": str(json_path), "png": str(png_path)}
        try:
            plot(
                png_path,
                title=f"ledgerbox soak {run_id} seed {seed}: {opts.duration_s:g} s, "
                f"{opts.rate_per_s:g} orders/s, {len(injector.records)} faults"
                + (f", PLANTED BUG {opts.plant_bug}" if opts.plant_bug else ""),
                t0=s.t0_wall,
                series=report["series"],
                samples=report["samples"],
                faults=report["faults"],
            )
        except RuntimeError as exc:
            report["files"]["png"] = f"not written: {exc}"
        json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print_summary(report)
        failed = report["failed_invariants"]
        missing = report["coverage"]["kinds_not_injected"]
        ok = bool(report["ok"])
        if failed:
            code = EXIT_INVARIANT
        elif missing:
            s.log(f"!! fault kinds never injected: {missing}")
            code = EXIT_INCOMPLETE
        else:
            code = EXIT_OK
        return code
    except Exception as exc:  # infrastructure failure: reported, exit 2
        s.log(f"!! soak aborted: {exc!r}")
        (s.out / "soak-report.json").write_text(
            json.dumps({"ok": False, "run_id": run_id, "seed": seed, "error": repr(exc)}) + "\n"
        )
        return EXIT_INCOMPLETE
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if monitor is not None:
            await monitor.aclose()
        if load is not None:
            load.close()
        keep = opts.cleanup == "never" or (opts.cleanup == "on-success" and not ok)
        await _cleanup(s, keep, services)


def _report(
    s: _Soak,
    opts: SoakOptions,
    plan: list[PlannedFault],
    injector: Injector,
    load: OrderLoad,
    monitor: Monitor,
    snapshot: checker.Snapshot,
    results: list[checker.InvariantResult],
    kafka: dict[str, Any],
    drain: Any,
    recovery: dict[int, float | None],
) -> dict[str, Any]:
    statuses = Counter(o.status for o in snapshot.orders)
    lat = checker.latencies_ms(snapshot.orders)
    failed = [r.name for r in results if not r.ok]
    injected = {r.kind for r in injector.records if r.ok}
    faults = []
    for r in sorted(injector.records, key=lambda r: r.index):
        d = r.as_dict()
        d["recovery_s"] = _round(recovery.get(r.index))
        faults.append(d)
    stats = load.stats
    return {
        "ok": not failed and not (set(opts.kinds) - injected),
        "run_id": s.run_id,
        "seed": s.seed,
        "replay": f"SOAK_SEED={s.seed} SOAK_S={opts.duration_s:g} make soak",
        "duration_s": opts.duration_s,
        "finished_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "liveness_bound_s": opts.liveness_bound_s,
        "orders": {
            "created": len(snapshot.orders),
            "paid": statuses.get("PAID", 0),
            "cancelled": statuses.get("CANCELLED", 0),
            "pending": statuses.get("PENDING", 0),
        },
        "load": {
            "rate_per_s": opts.rate_per_s,
            "ticks": stats.ticks,
            "shed": stats.shed,
            "answered": stats.answered,
            "abandoned": stats.abandoned,
            "transport_errors": stats.transport_errors,
            "server_errors": stats.server_errors,
            "client_errors": stats.client_errors,
            "same_key_retries": stats.same_key_retries,
            "replays": stats.replays,
            "topups": stats.topups,
            "topup_failures": stats.topup_failures,
        },
        "latency_ms": {
            "what": "order created_at (placing tx) -> closed_at (order consumer tx), DB clock",
            "count": len(lat),
            "p50": _round(checker.percentile(lat, 50)),
            "p99": _round(checker.percentile(lat, 99)),
            "max": _round(lat[-1] if lat else None),
        },
        "kafka": kafka,
        "drain": drain.as_dict(),
        "coverage": {
            "kinds_planned": sorted({f.kind for f in plan}),
            "kinds_not_injected": sorted(set(opts.kinds) - injected),
        },
        "faults_per_kind": per_kind(plan, injector.records, recovery),
        "faults": faults,
        "online_checks": monitor.online,
        "invariants": [r.as_dict() for r in results],
        "failed_invariants": failed,
        "processes": {
            name: {
                "kills": p.kills,
                "pauses": p.pauses,
                "restarts": p.restarts,
                "crashes": p.unexpected_exits,
            }
            for name, p in s.procs.items()
        },
        "services_calls": [
            {"command": c, "took_s": round(t, 1), "rc": rc} for c, t, rc in injector.services.calls
        ],
        "process_exits": s.exits,
        "series": buckets(snapshot.orders, s.t0_wall, 10.0 if opts.duration_s >= 600 else 5.0),
        "samples": monitor.as_dicts(),
    }
