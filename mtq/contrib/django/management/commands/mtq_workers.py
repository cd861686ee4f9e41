"""``manage.py mtq_workers [TARGET] [--devices ...] [--replicas N]``: ``mtq workers
start`` on the project's Redis and queue, TARGET defaulting to ``MTQ["WORKERS"]``.
SIGTERM drains and stops them (exit 0)."""

from __future__ import annotations

from typing import Any

from mtq.contrib.django.commands import ClickCommand, workers_command


class Command(ClickCommand):
    help = "Serve the project's queue: 'mtq workers start' with MTQ['WORKERS'] and MTQ['QUEUE']."

    def click_command(self) -> Any:
        return workers_command()
