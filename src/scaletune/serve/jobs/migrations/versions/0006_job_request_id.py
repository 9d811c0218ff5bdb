"""jobs.request_id: the client's id for a submission, so that sending it again is idempotent

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("request_id", sa.String(64), nullable=True))
        batch.create_unique_constraint("uq_jobs_owner_request_id", ["owner", "request_id"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint("uq_jobs_owner_request_id", type_="unique")
        batch.drop_column("request_id")
