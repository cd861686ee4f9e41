"""Integrations with other software. Each module imports its framework itself, so
``import mtq`` never needs one: :mod:`mtq.contrib.sse` (no framework: server-sent
events for any server), :mod:`mtq.contrib.web` (no framework: a request's tenant,
priority and deadline), :mod:`mtq.contrib.asgi` (Starlette, FastAPI, any ASGI)."""
