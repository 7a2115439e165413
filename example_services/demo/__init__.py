"""The end-to-end demo: ``python -m example_services.demo --help``.

It creates the two service databases, starts the six processes (two APIs, two relays, two
consumers), seeds wallets, sends orders from an async load generator while injecting faults
(kill -9 of a relay and a consumer, a Redis outage, duplicate Kafka deliveries), waits until
everything drained, and checks the invariants (:mod:`example_services.demo.checker`) from the
databases. The summary goes to stdout and ``demo-results/summary.json``; the exit code is 0
only if every invariant holds.
"""

__all__: list[str] = []
