"""The Django app: ``INSTALLED_APPS = [..., "mtq.contrib.django"]``."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core.signals import setting_changed


class MtqConfig(AppConfig):
    """Registers mtq's system checks (mtq.E001, E002, E003, W001) and forgets the cached
    settings and queues when ``MTQ`` changes (``override_settings``)."""

    name = "mtq.contrib.django"
    label = "mtq"
    verbose_name = "mtq task queue"
    default = True

    def ready(self) -> None:
        from mtq.contrib.django import checks  # noqa: F401  (registers them)

        setting_changed.connect(_setting_changed, dispatch_uid="mtq.setting_changed")


def _setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting == "MTQ":
        from mtq.contrib.django.queues import clear_cache

        clear_cache()
