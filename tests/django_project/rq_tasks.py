"""A job that a django-rq app enqueues and ``mtq rq worker`` runs."""

from __future__ import annotations

from django.apps import apps


def word_count(text: str) -> dict:
    """Needs Django set up in the worker process (the app registry), as a job that
    uses the ORM does."""
    apps.check_apps_ready()
    return {"words": len(text.split()), "django_rq": apps.is_installed("django_rq")}
