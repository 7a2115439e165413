# Image of the ledgerbox processes in docker-compose.yml (relays, consumers, example APIs).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md* ./
COPY ledgerbox ./ledgerbox
COPY outbox ./outbox
COPY relay ./relay
COPY inbox ./inbox
COPY migrations ./migrations
COPY example_services ./example_services
COPY alembic.ini ./
RUN pip install --no-cache-dir '.[services]'
USER nobody
