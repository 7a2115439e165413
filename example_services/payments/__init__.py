"""The payment service: debits wallets for ``OrderPlaced``, emits the payment result.

Processes: the API (``uvicorn --factory example_services.payments.api:create_app``), its relay
(``python -m ledgerbox.relay run`` with ``DATABASE_URL`` = the payment database) and its consumer
(``python -m ledgerbox.inbox run --app example_services.payments.consumer:consumer``).
"""

__all__: list[str] = []
