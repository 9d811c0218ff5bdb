"""`scaletune remote`: the job service's client for scripts and CI (HTTP calls, waiting, logs, downloads)."""
