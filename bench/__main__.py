"""``python -m bench [NAME ...]``: run the benchmarks, write ``bench/results/latest.json``.

Each benchmark module exposes ``run() -> dict[str, object]`` that warms up, measures several
rounds side by side (median of >= 3) and returns its figures, the raw numbers behind every ratio
included. This entry merges them, adds the machine, checks the targets and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from typing import Any

from bench._common import RESULTS_DIR

BENCHES: dict[str, str] = {
    "write_overhead": "bench.write_overhead",
    "relay_drain": "bench.relay_drain",
    "inbox_apply": "bench.inbox_apply",
    "e2e_latency": "bench.e2e_latency",
    "demo_pipeline": "bench.demo_pipeline",
    "peers": "bench.peers",
}

# key: (comparison, bound). Ratios are measured side by side in one run.
TARGETS: dict[str, tuple[str, float]] = {
    "relay_vs_raw_ratio": (">=", 0.8),
    "relay_vs_peer_ratio": (">=", 10.0),
    "hot_keys_ratio": (">=", 0.8),
    "relay_scaling_2_vs_1": (">=", 1.0),
    "relay_history_ratio": (">=", 0.9),
    "relay_cpu_us_per_event": ("<=", 100.0),
    "e2e_p99_ms": ("<=", 50.0),
    "e2e_p50_ms": ("<=", 10.0),
    "write_overhead_ratio": ("<=", 1.35),
    "write_overhead_order_tx": ("<=", 1.15),
    "inbox_vs_plain_ratio": (">=", 0.9),  # issue 14 (was 0.7)
    "inbox_redis_overhead_us_per_event": ("<=", 150.0),  # issue 14
    "relay_peak_rss_mb": ("<=", 100.0),
    "demo_pipeline_max_orders_per_s": (">=", 400.0),
    "demo_pipeline_100_p50_ms": ("<=", 30.0),
    "demo_pipeline_100_p99_ms": ("<=", 150.0),
}


#: Figures printed under the targets (context for reading them; no bound).
CONTEXT = (
    "inbox_unbatched_overhead_us_per_event",
    "inbox_redis_unbatched_overhead_us_per_event",
    "relay_events_per_s",
    "raw_producer_events_per_s",
    "relay_empty_table_events_per_s",
    "relay_history_events_per_s",
    "relay_cpu_us_per_event_light",
    "e2e_relay_hop_p50_ms",
    "e2e_consumer_hop_p50_ms",
    "e2e_light_p50_ms",
    "e2e_light_p99_ms",
    "inbox_events_per_s",
    "plain_consumer_events_per_s",
    "demo_pipeline_max_api",
    "demo_pipeline_500_sustained",
    "demo_pipeline_500_p50_ms",
    "demo_pipeline_200_p50_ms",
    "demo_pipeline_200_p99_ms",
    "demo_pipeline_100_http_p99_ms",
)


def _machine() -> dict[str, Any]:
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            mem_gib = round(int(f.readline().split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _derive(result: dict[str, Any]) -> None:
    peers = [
        v
        for k, v in result.items()
        if k.startswith("peer_") and k.endswith("_events_per_s") and isinstance(v, int | float)
    ]
    if peers and isinstance(result.get("relay_events_per_s"), int | float):
        result["relay_vs_peer_ratio"] = result["relay_events_per_s"] / max(peers)


def _verdicts(result: dict[str, Any]) -> dict[str, str]:
    verdicts = {}
    for key, (op, bound) in TARGETS.items():
        value = result.get(key)
        if not isinstance(value, int | float):
            verdicts[key] = "not measured"
            continue
        ok = value >= bound if op == ">=" else value <= bound
        verdicts[key] = f"{'met' if ok else 'MISSED'} ({op} {bound:g})"
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"any of {', '.join(BENCHES)}; default: all")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(BENCHES))
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    names = args.names or list(BENCHES)
    latest = RESULTS_DIR / "latest.json"
    result: dict[str, Any] = json.loads(latest.read_text()) if latest.exists() else {}
    failures: dict[str, str] = {}
    for name in names:
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        try:
            figures = importlib.import_module(BENCHES[name]).run()
        except Exception as exc:  # a broken benchmark is reported, the others still run
            failures[name] = f"{type(exc).__name__}: {exc}"
            print(f"   failed: {failures[name]}", file=sys.stderr, flush=True)
            continue
        result.update(figures)
        print(f"   done in {time.perf_counter() - started:.0f} s", flush=True)
    _derive(result)
    result["machine"] = _machine()
    result["verdicts"] = _verdicts(result)
    result["failures"] = failures
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    RESULTS_DIR.mkdir(exist_ok=True)
    latest.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"\n{'metric':32} {'value':>14}  target")
    for key in TARGETS:
        value = result.get(key)
        shown = f"{value:14.3f}" if isinstance(value, int | float) else f"{'-':>14}"
        print(f"{key:32} {shown}  {result['verdicts'][key]}")
    for key in CONTEXT:
        value = result.get(key)
        if isinstance(value, int | float):
            print(f"{key:32} {value:14.3f}")
    print(f"\nwritten: {latest}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
