"""Alembic environment of the job database: the URL comes from the caller (`serve.jobs.db.upgrade`)."""

from alembic import context
from sqlalchemy import create_engine

from scaletune.serve.jobs.db import Base

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
            context.run_migrations()
    engine.dispose()
