"""tasks: the evaluate and export tasks of a job, kept across restarts

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tasks",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id"), nullable=False, index=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("what", sa.Text, nullable=False, server_default=""),
        sa.Column("owner", sa.String(64), nullable=False, server_default=""),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("result", sa.JSON, nullable=True),
        sa.Column("message", sa.Text, nullable=False, server_default=""),
        sa.Column("started", sa.Float, nullable=False),
        sa.Column("ended", sa.Float, nullable=True),
        sa.Column("seen", sa.Float, nullable=False),
        sa.Column("host", sa.String(255), nullable=False, server_default=""),
        sa.Column("service", sa.String(64), nullable=False, server_default=""),
        sa.Column("pid", sa.Integer, nullable=True),
        sa.Column("pid_mark", sa.String(32), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("tasks")
