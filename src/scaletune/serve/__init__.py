"""`scaletune serve`: the job API and web page (FastAPI), job records (SQLAlchemy), dispatchers local / slurm / modal."""
