"""The web dashboard: ``mtq dashboard --web``, and ``/dashboard`` of ``mtq serve``
(see docs/dashboard.md)."""
