"""Alembic environment of the job database: the URL comes from the caller (`serve.jobs.db.upgrade`)."""

from alembic import context
from sqlalchemy import create_engine, text

from scaletune.serve.jobs.db import Base

# Replicas of a deployment start together on one Postgres and each runs the migrations: without a
# lock two create the same tables and one dies on Postgres's unique type names. A transaction-scoped
# advisory lock (released at commit) lets one migrate while the others wait, then find the head.
# SQLite files take turns under a file lock instead (`upgrade`). The key is arbitrary but fixed.
MIGRATIONS_LOCK = 0x5CA1E7E

config = context.config
url = config.get_main_option("sqlalchemy.url")
if context.is_offline_mode():
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = create_engine(url)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATIONS_LOCK})
            context.run_migrations()
    engine.dispose()
