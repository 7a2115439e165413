"""The soak's final report: a text summary, ``soak-report.json`` and ``soak-report.png``.

The plot (matplotlib, the ``soak`` extra: ``pip install -e '.[soak]'``) has three panels over
the soak's time axis, each fault a shaded span labelled with its plan index:
throughput (orders created and closed per second, 10 s buckets, from the database
timestamps), backlog (open orders and pending outbox rows, 1 s samples; gaps = the database
could not be read), and commit -> applied latency (order created -> closed, p50 and p99 per
10 s bucket of closing time, log scale).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from example_services.demo.checker import OrderRow, percentile
from example_services.soak.faults import FaultRecord
from example_services.soak.schedule import KIND_NAMES, PlannedFault

__all__ = ["FAMILY_COLOURS", "buckets", "per_kind", "plot", "print_summary"]

BUCKET_S = 10.0
FAMILY_COLOURS = {
    "relay": "#1f77b4",
    "consumer": "#17becf",
    "broker": "#d62728",
    "min": "#ff7f0e",
    "cluster": "#8c564b",
    "pg": "#2ca02c",
    "redis": "#e377c2",
    "net": "#9467bd",
    "duplicates": "#7f7f7f",
}


def buckets(orders: Sequence[OrderRow], t0: float, width_s: float = BUCKET_S) -> dict[str, Any]:
    """Created/closed per second and latency percentiles per ``width_s`` bucket from ``t0``."""
    created: dict[int, int] = defaultdict(int)
    closed: dict[int, int] = defaultdict(int)
    lat: dict[int, list[float]] = defaultdict(list)
    for o in orders:
        if o.created_at is not None:
            created[int((o.created_at.timestamp() - t0) // width_s)] += 1
        if o.closed_at is not None and o.created_at is not None:
            b = int((o.closed_at.timestamp() - t0) // width_s)
            closed[b] += 1
            lat[b].append((o.closed_at - o.created_at).total_seconds() * 1000.0)
    keys = sorted(set(created) | set(closed))
    rows = []
    for b in keys:
        values = sorted(lat.get(b, []))
        rows.append(
            {
                "t_s": b * width_s,
                "created_per_s": created.get(b, 0) / width_s,
                "closed_per_s": closed.get(b, 0) / width_s,
                "latency_p50_ms": percentile(values, 50),
                "latency_p99_ms": percentile(values, 99),
            }
        )
    return {"width_s": width_s, "rows": rows}


def per_kind(
    plan: Sequence[PlannedFault],
    records: Sequence[FaultRecord],
    recovery: Mapping[int, float | None],
) -> dict[str, dict[str, Any]]:
    """Per kind: planned, injected ok, failed, and the worst recovery time (s; ``"never"``:
    some order created before the fault ended never closed)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in KIND_NAMES:
        mine = [r for r in records if r.kind == kind]
        planned = sum(1 for f in plan if f.kind == kind)
        if not planned:
            continue
        recs = [recovery.get(r.index) for r in mine if r.ok]
        worst: float | str | None = None
        if any(x is None for x in recs):
            worst = "never"
        elif recs:
            worst = round(max(x for x in recs if x is not None), 1)
        out[kind] = {
            "planned": planned,
            "ok": sum(1 for r in mine if r.ok),
            "failed": sum(1 for r in mine if not r.ok),
            "max_recovery_s": worst,
        }
    return out


def plot(
    path: Path,
    *,
    title: str,
    t0: float,
    series: Mapping[str, Any],
    samples: Sequence[Mapping[str, Any]],
    faults: Sequence[Mapping[str, Any]],
) -> Path:
    """Write the PNG; returns its path.

    Raises
    ------
    RuntimeError
        If matplotlib is not installed (with the install hint).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            "the soak plot needs matplotlib: pip install -e '.[soak]' (make soak does it)"
        ) from exc
    rows = series["rows"]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(14, 10), sharex=True)
    t = [r["t_s"] for r in rows]
    ax1.plot(t, [r["created_per_s"] for r in rows], label="orders created /s", lw=1.2)
    ax1.plot(
        t, [r["closed_per_s"] for r in rows], label="orders closed (paid/cancelled) /s", lw=1.2
    )
    ax1.set_ylabel("throughput (/s)")
    st = [s["t"] - t0 for s in samples]
    ax2.plot(st, [s["pending"] for s in samples], label="open orders", lw=1.0)
    ax2.plot(st, [s["outbox_order"] for s in samples], label="pending outbox (orders)", lw=0.8)
    ax2.plot(st, [s["outbox_payment"] for s in samples], label="pending outbox (payments)", lw=0.8)
    ax2.set_ylabel("backlog")
    ax3.plot(t, [r["latency_p50_ms"] for r in rows], label="commit -> applied p50", lw=1.2)
    ax3.plot(t, [r["latency_p99_ms"] for r in rows], label="commit -> applied p99", lw=1.2)
    ax3.set_yscale("log")
    ax3.set_ylabel("latency (ms)")
    ax3.set_xlabel("seconds since the soak started")
    seen: set[str] = set()
    for f in faults:
        if f.get("started_s") is None or f.get("ended_s") is None:
            continue
        family = f["kind"].split("-")[0]
        colour = FAMILY_COLOURS.get(family, "#bcbd22")
        end = max(f["ended_s"], f["started_s"] + 0.5)
        for ax in (ax1, ax2, ax3):
            ax.axvspan(
                f["started_s"],
                end,
                color=colour,
                alpha=0.15,
                label=family if ax is ax2 and family not in seen else None,
            )
        seen.add(family)
        ax1.annotate(
            f"{f['index']}:{f['kind']}",
            (f["started_s"], 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize=6,
            va="top",
            color=colour,
        )
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    ax1.legend(loc="lower left", fontsize=7)
    ax2.legend(loc="upper left", fontsize=7, ncol=3)
    ax3.legend(loc="upper left", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_summary(report: Mapping[str, Any]) -> None:
    o = report["orders"]
    lines = [
        "",
        "=" * 78,
        f"ledgerbox soak {report['run_id']} (seed {report['seed']}, {report['duration_s']:g} s): "
        + ("ALL INVARIANTS HOLD" if report["ok"] else "FAILED"),
        "=" * 78,
        f"orders      created {o['created']}: paid {o['paid']}, cancelled {o['cancelled']}, "
        f"open {o['pending']}; {report['load']['rate_per_s']:g}/s offered, "
        f"shed {report['load']['shed']}, abandoned {report['load']['abandoned']}",
        f"http        answered {report['load']['answered']}, transport errors "
        f"{report['load']['transport_errors']}, 5xx {report['load']['server_errors']}, "
        f"same-key retries {report['load']['same_key_retries']}, planned replays answered "
        f"with the first order {report['load']['replays']}",
        f"latency     commit -> applied p50 {report['latency_ms']['p50']} ms, "
        f"p99 {report['latency_ms']['p99']} ms, max {report['latency_ms']['max']} ms",
        f"kafka       records orders {report['kafka']['orders_records']} "
        f"(unique {report['kafka']['orders_unique']}), payments "
        f"{report['kafka']['payments_records']} (unique {report['kafka']['payments_unique']})",
        "faults per kind (injected ok / planned):",
    ]
    for kind, c in report["faults_per_kind"].items():
        worst = c["max_recovery_s"]
        lines.append(
            f"  {kind:<16} {c['ok']:>3} / {c['planned']:<3} worst recovery "
            f"{'never' if worst == 'never' else worst} s"
            + (f"  ({c['failed']} failed to inject)" if c["failed"] else "")
        )
    missing = report["coverage"]["kinds_not_injected"]
    if missing:
        lines.append(f"  NOT INJECTED: {', '.join(missing)}")
    lines.append(f"invariants (liveness bound {report['liveness_bound_s']:g} s):")
    for inv in report["invariants"]:
        mark = "ok  " if inv["ok"] else "FAIL"
        lines.append(f"  [{mark}] {inv['name']:<34} checked {inv['checked']:>7}")
        if not inv["ok"]:
            lines.append(f"         {inv['violations']} violation(s), e.g.:")
            lines.extend(f"           - {example}" for example in inv["examples"][:5])
    lines.append(f"report      {report['files']['json']}  plot {report['files']['png']}")
    print("\n".join(lines), flush=True)
