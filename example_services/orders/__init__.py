"""The order service: ``POST /orders`` + ``OrderPlaced`` in one transaction; payment results.

Processes: the API (``uvicorn --factory example_services.orders.api:create_app``), its relay
(``python -m ledgerbox.relay run`` with ``DATABASE_URL`` = the order database) and its consumer
(``python -m ledgerbox.inbox run --app example_services.orders.consumer:consumer``).
"""

__all__: list[str] = []
