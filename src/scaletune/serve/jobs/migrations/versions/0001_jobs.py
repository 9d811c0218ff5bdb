"""jobs, events, metrics, tokens

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("phase", sa.String(32)),
        sa.Column("stage", sa.String(200)),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("reason", sa.String(64)),
        sa.Column("message", sa.Text),
        sa.Column("target", sa.String(16), nullable=False),
        sa.Column("target_id", sa.String(200)),
        sa.Column("config_yaml", sa.Text, nullable=False),
        sa.Column("overrides", sa.JSON, nullable=False),
        sa.Column("resources", sa.JSON, nullable=False),
        sa.Column("secret_refs", sa.JSON, nullable=False),
        sa.Column("job_dir", sa.Text, nullable=False),
        sa.Column("run_dir", sa.Text, nullable=False),
        sa.Column("last_metrics", sa.JSON),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("exit_code", sa.Integer),
        sa.Column("stop_requested", sa.Integer, nullable=False),
        sa.Column("created", sa.DateTime, nullable=False),
        sa.Column("updated", sa.DateTime, nullable=False),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id"), nullable=False, index=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
        sa.Column("created", sa.DateTime, nullable=False),
    )
    op.create_table(
        "metrics",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id"), nullable=False, index=True),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("loss", sa.Float),
        sa.Column("data", sa.JSON, nullable=False),
        sa.UniqueConstraint("job_id", "step", "kind"),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("hash", sa.String(64), nullable=False, unique=True),
        sa.Column("scope", sa.String(8), nullable=False),
        sa.Column("created", sa.DateTime, nullable=False),
    )


def downgrade() -> None:
    for table in ("tokens", "metrics", "events", "jobs"):
        op.drop_table(table)
