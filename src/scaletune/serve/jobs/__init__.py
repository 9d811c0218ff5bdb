"""The job service: records, database, watcher, dispatchers and the work done on a job's files."""
