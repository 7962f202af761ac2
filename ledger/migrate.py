"""Schema migrations through Alembic, with the scripts shipped inside the installed package (``migrations``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

import migrations
from ledger.store import make_engine, schema_revision


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def heads(url: str = "sqlite://") -> list[str]:
    return list(ScriptDirectory.from_config(alembic_config(url)).get_heads())


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def current(url: str) -> str | None:
    engine = make_engine(url)
    try:
        return schema_revision(engine)
    finally:
        engine.dispose()
