"""The REST API: one FastAPI router per resource, and the request and response bodies."""
