"""The chaos soak of the example services on a 3-broker Kafka cluster (``make soak``).

Modules: ``proxy`` (userspace TCP fault proxy), ``schedule`` (the seeded fault plan, pure),
``faults`` (what each fault kind does), ``load`` (lean HTTP load), ``monitor`` (samples and
progress lines), ``invariants`` (the soak's checks beyond the demo's), ``report`` (JSON + PNG),
``_run`` (orchestration). Entry point: ``python -m example_services.soak``.
"""
