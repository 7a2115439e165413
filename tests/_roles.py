"""The least-privilege roles of docs/security.md, created from the SQL in the doc itself (so the
doc and the tests cannot drift apart), under unique names for one test."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import make_url

DOC = Path(__file__).resolve().parents[1] / "docs" / "security.md"
ROLES = ("relay", "consumer", "app", "operator")


def roles_sql() -> str:
    """The SQL between ``<!-- roles:begin -->`` and ``<!-- roles:end -->`` of the doc."""
    text = DOC.read_text()
    block = text.split("<!-- roles:begin -->", 1)[1].split("<!-- roles:end -->", 1)[0]
    return block.strip().removeprefix("```sql").removesuffix("```").strip()


def doc_grants() -> dict[str, dict[str, set[str]]]:
    """``role -> table -> privileges`` granted by the doc's SQL."""
    grants: dict[str, dict[str, set[str]]] = {r: {} for r in ROLES}
    pattern = re.compile(r"GRANT (.+?) ON (?!SCHEMA)(\S+) TO ledgerbox_(\w+);")
    for privileges, table, role in pattern.findall(roles_sql()):
        grants[role].setdefault(table, set()).update(p.strip() for p in privileges.split(","))
    return grants


@dataclass(frozen=True)
class Roles:
    """The roles of one test: ``names[role]`` and ``urls[role]`` (the database URL as
    that role, with its password)."""

    names: dict[str, str]
    passwords: dict[str, str]
    urls: dict[str, str]


def execute(url: str, *statements: str) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            for statement in statements:
                conn.execute(sa.text(statement))
    finally:
        engine.dispose()


@contextmanager
def doc_roles(admin_url: str, passwords: dict[str, str] | None = None) -> Iterator[Roles]:
    """Create the doc's roles in the database of ``admin_url`` (a superuser URL), named
    ``ledgerbox_<role>_<random>``, with ``passwords`` (per role; default: random); dropped
    afterwards."""
    suffix = uuid.uuid4().hex[:8]
    # Roles without a chosen password get a random one (a role added to the doc later too).
    chosen = {r: f"{r}-pw-{uuid.uuid4().hex[:12]}" for r in ROLES} | (passwords or {})
    names = {r: f"ledgerbox_{r}_{suffix}" for r in ROLES}
    sql = roles_sql()
    doc_passwords = dict(re.findall(r"ROLE ledgerbox_(\w+) LOGIN PASSWORD '([^']*)'", sql))
    for role in ROLES:
        sql = sql.replace(f"'{doc_passwords[role]}'", f"'{chosen[role]}'")
        sql = re.sub(rf"\bledgerbox_{role}\b", names[role], sql)
    statements = [s.strip() for s in sql.split(";") if _code(s)]
    url = make_url(admin_url)
    urls = {
        r: url.set(username=names[r], password=chosen[r]).render_as_string(hide_password=False)
        for r in ROLES
    }
    execute(admin_url, *statements)
    try:
        yield Roles(names, chosen, urls)
    finally:
        database = url.database
        for role in names.values():
            execute(
                admin_url,
                f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'",  # noqa: S608 (a generated role name)
                f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}",
                f"REVOKE ALL ON SCHEMA public FROM {role}",
                f'REVOKE ALL ON DATABASE "{database}" FROM {role}',
                f"DROP ROLE {role}",
            )


def _code(statement: str) -> bool:
    return any(
        line.strip() and not line.strip().startswith("--") for line in statement.splitlines()
    )
