"""Example services built on ledgerbox: an order service and a payment service, and the demo.

Only the public names of ``outbox``, ``relay`` and ``inbox`` are used here, so these modules
double as a worked example of the library:

- ``example_services.orders``: ``POST /orders`` writes the order and its ``OrderPlaced``
  event in one transaction; its consumer applies ``PaymentSucceeded`` / ``PaymentFailed``.
- ``example_services.payments``: its consumer debits the customer's wallet for each
  ``OrderPlaced`` and emits the payment result through its own outbox.
- ``example_services.demo``: starts everything, sends load, injects faults, and checks the
  invariants from the databases (``python -m example_services.demo --help``).
"""

__all__: list[str] = []
