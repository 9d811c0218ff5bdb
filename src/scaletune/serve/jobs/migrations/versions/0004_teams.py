"""teams: named and revocable tokens, a job's owner, the audit record

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("name", sa.String(64), nullable=True))
        batch.add_column(sa.Column("created_by", sa.String(64), nullable=False, server_default=""))
        batch.add_column(sa.Column("revoked", sa.DateTime, nullable=True))
    # Tokens made before names existed are named by their row, so each can be listed and revoked.
    op.execute("UPDATE tokens SET name = scope || '-' || id WHERE name IS NULL")
    with op.batch_alter_table("tokens") as batch:
        batch.alter_column("name", existing_type=sa.String(64), nullable=False)
        batch.create_unique_constraint("uq_tokens_name", ["name"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("owner", sa.String(64), nullable=False, server_default=""))
    op.create_table(
        "audit",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.DateTime, nullable=False, index=True),
        sa.Column("actor", sa.String(64), nullable=False, index=True),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("job_id", sa.String(32), nullable=True, index=True),
        sa.Column("detail", sa.Text, nullable=False, server_default=""),
    )


def downgrade() -> None:
    op.drop_table("audit")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("owner")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_constraint("uq_tokens_name", type_="unique")
        batch.drop_column("revoked")
        batch.drop_column("created_by")
        batch.drop_column("name")
