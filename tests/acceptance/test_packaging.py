"""What ``pip install ledgerbox`` puts into site-packages, and living beside a user's own
``migrations/`` package (what ``alembic init migrations`` creates in most services).

The wheel is built from a copy of the tracked files (as a fresh clone has them), so a file
that only exists in this working tree cannot make the test pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests._services import REPO_ROOT


def _tracked_copy(dest: Path) -> Path:
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for raw in files:
        if not raw:
            continue
        rel = Path(os.fsdecode(raw))
        src, dst = REPO_ROOT / rel, dest / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree, not yet committed
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = _tracked_copy(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (built,) = out.glob("ledgerbox-*.whl")
    return built


def test_the_wheel_installs_exactly_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/", 1)[0] for name in names if ".dist-info/" not in name}
    assert top == {"ledgerbox"}, f"top-level names in {wheel.name}: {sorted(top)}"
    top_level_txt = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level_txt).decode().split() == ["ledgerbox"]


def test_the_wheel_carries_every_subpackage_and_the_migration_scripts(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "ledgerbox/__init__.py",
        "ledgerbox/_core/faults.py",
        "ledgerbox/outbox/__init__.py",
        "ledgerbox/relay/__init__.py",
        "ledgerbox/inbox/__init__.py",
        "ledgerbox/migrations/env.py",
        "ledgerbox/migrations/script.py.mako",
        "ledgerbox/migrations/versions/0001_ledgerbox_tables.py",
        "ledgerbox/migrations/versions/0002_relay_snapshot_cursor.py",
        "ledgerbox/migrations/versions/0003_operator_tables.py",
        "ledgerbox/admin/__init__.py",
        "ledgerbox/py.typed",
    ):
        assert required in names, required
    assert not [n for n in names if n.startswith(("example_services/", "tests/", "bench/"))]


_USER_ENV = """
from alembic import context
from sqlalchemy import create_engine, pool

config = context.config
engine = create_engine(config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool)
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=None)
    with context.begin_transaction():
        context.run_migrations()
"""

_USER_REVISION = '''
"""the user's own revision that embeds the ledgerbox tables"""
from alembic import op

from ledgerbox.migrations import ops

revision = "u0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE TABLE orders (id bigint PRIMARY KEY)")
    ops.create_outbox_v1(op, "outbox", None)
    ops.create_inbox_v1(op, "inbox", None)
    ops.create_relay_v1(op, "outbox", None)


def downgrade() -> None:
    ops.drop_relay_v1(op, "outbox", None)
    ops.drop_inbox_v1(op, "inbox", None)
    ops.drop_outbox_v1(op, "outbox", None)
    op.execute("DROP TABLE orders")
'''


# The user's revision that takes the embedded tables to ledgerbox's schema revision 2 (the
# snapshot cursor), as docs/migrations.md says: one revision calling the new ops in order.
_USER_REVISION_2 = '''
"""the user's revision for ledgerbox schema revision 2"""
from alembic import op

from ledgerbox.migrations import ops

revision = "u0002"
down_revision = "u0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    ops.upgrade_outbox_v1_to_v2(op, "outbox", None)
    ops.upgrade_relay_v1_to_v2(op, "outbox", None)


def downgrade() -> None:
    ops.downgrade_outbox_v2_to_v1(op, "outbox", None)
    ops.downgrade_relay_v2_to_v1(op, "outbox", None)
'''


# Revision 3 (the operator tables): again one revision of the user's calling the new ops.
_USER_REVISION_3 = '''
"""the user's revision for ledgerbox schema revision 3"""
from alembic import op

from ledgerbox.migrations import ops

revision = "u0003"
down_revision = "u0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    ops.create_ops_v3(op, None)


def downgrade() -> None:
    ops.drop_ops_v3(op, None)
'''


def _user_project(root: Path, database_url: str) -> Path:
    """A service laid out as ``alembic init migrations`` leaves it, with a package marker."""
    mig = root / "migrations"
    (mig / "versions").mkdir(parents=True)
    (mig / "__init__.py").write_text("# the user's own package named migrations\n")
    (mig / "env.py").write_text(_USER_ENV)
    (mig / "script.py.mako").write_text("")
    (mig / "versions" / "u0001_orders.py").write_text(_USER_REVISION)
    (mig / "versions" / "u0002_ledgerbox_v2.py").write_text(_USER_REVISION_2)
    (mig / "versions" / "u0003_ledgerbox_v3.py").write_text(_USER_REVISION_3)
    (root / "alembic.ini").write_text(
        "[alembic]\nscript_location = migrations\n"
        f"sqlalchemy.url = {database_url.replace('%', '%%')}\n"
    )
    return root


def _tables(database_url: str) -> set[str]:
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return set(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()


def test_ledgerbox_migrate_works_from_a_project_with_its_own_migrations_package(
    tmp_path: Path, empty_database_url: str
) -> None:
    project = _user_project(tmp_path, empty_database_url)
    result = subprocess.run(
        [sys.executable, "-m", "ledgerbox", "migrate", "--database-url", empty_database_url],
        cwd=project, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert {"outbox", "inbox", "outbox_relay_lease"} <= _tables(empty_database_url)


def test_a_users_alembic_revisions_import_ledgerbox_ops_beside_their_own_migrations(
    tmp_path: Path, empty_database_url: str
) -> None:
    project = _user_project(tmp_path, empty_database_url)
    alembic = Path(sys.executable).with_name("alembic")
    result = subprocess.run(
        [str(alembic), "upgrade", "head"],
        cwd=project, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert {"orders", "outbox", "inbox", "outbox_relay_lease", "outbox_relay_tick"} <= _tables(
        empty_database_url
    )
    assert {"ledgerbox_ops_audit", "ledgerbox_dlq_action"} <= _tables(empty_database_url)
    # Revisions 1, 2, 3 through the frozen ops: the models of the current version match.
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from ledgerbox.migrations import include_tables

    metadata = sa.MetaData()
    sa.Table("orders", metadata, sa.Column("id", sa.BigInteger, primary_key=True))
    include_tables(metadata)
    engine = sa.create_engine(empty_database_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), metadata
            )
    finally:
        engine.dispose()
    assert diff == [], diff
    downgrade = subprocess.run(
        [str(alembic), "downgrade", "base"],
        cwd=project, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert downgrade.returncode == 0, downgrade.stderr


def test_failsafe_08_migrate_on_tables_of_an_embedding_env_says_what_to_do(
    tmp_path: Path, empty_database_url: str
) -> None:
    """Issue 12 line 8: ``ledgerbox migrate`` on a database the user's own Alembic env had
    migrated failed with "relation outbox already exists" and a 29-line statement."""
    project = _user_project(tmp_path, empty_database_url)
    alembic = Path(sys.executable).with_name("alembic")
    subprocess.run([str(alembic), "upgrade", "head"], cwd=project, check=True, capture_output=True)
    result = subprocess.run(
        [sys.executable, "-m", "ledgerbox", "migrate", "--database-url", empty_database_url],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "your own Alembic environment" in lines[0] and "docs/migrations.md" in lines[0]
    assert "Traceback" not in result.stderr and "CREATE TABLE" not in result.stderr


def test_failsafe_08_include_tables_keeps_autogenerate_from_dropping_ledgerbox_tables(
    tmp_path: Path, empty_database_url: str
) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from ledgerbox.migrations import include_tables
    from ledgerbox.outbox import OutboxTable

    project = _user_project(tmp_path, empty_database_url)
    alembic = Path(sys.executable).with_name("alembic")
    subprocess.run([str(alembic), "upgrade", "head"], cwd=project, check=True, capture_output=True)

    def proposed(metadata: sa.MetaData) -> list[str]:
        engine = sa.create_engine(empty_database_url, poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                context = MigrationContext.configure(conn)
                diff = compare_metadata(context, metadata)
        finally:
            engine.dispose()
        return sorted(
            str(d[1].name) for d in diff if isinstance(d, tuple) and d[0] == "remove_table"
        )

    only_outbox = sa.MetaData()
    OutboxTable(metadata=only_outbox)
    assert "inbox" in proposed(only_outbox), "the trap this helper exists for"
    full = sa.MetaData()
    sa.Table("orders", full, sa.Column("id", sa.BigInteger, primary_key=True))
    include_tables(full)
    assert proposed(full) == []
