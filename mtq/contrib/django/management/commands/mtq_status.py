"""``manage.py mtq_status [QUEUE] [--json]``: ``mtq status`` on the project's Redis."""

from __future__ import annotations

from typing import Any

from mtq.contrib.django.commands import ClickCommand, status_command


class Command(ClickCommand):
    help = "The project's mtq queues: 'mtq status' on MTQ['REDIS_URL']."

    def click_command(self) -> Any:
        return status_command()
