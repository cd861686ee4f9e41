"""mtq's errors raised in a view, answered as JSON.

Add ``"mtq.contrib.django.middleware.MtqErrorMiddleware"`` to ``MIDDLEWARE``: an
:class:`~mtq.errors.MtqError` a view raises (``submit`` on a full queue, an unknown
task) becomes :func:`~mtq.contrib.django.responses.error_response`, e.g. a 503 with
``Retry-After`` for ``QueueFull`` rather than a 500 page, a 429 with ``Retry-After``
for ``RateLimited``. Sync and async views both.
Other exceptions are left to Django.
"""

from __future__ import annotations

import logging

from django.http import HttpRequest, HttpResponse
from django.utils.deprecation import MiddlewareMixin

from mtq.contrib.django.responses import error_response
from mtq.contrib.sse import http_error
from mtq.errors import MtqError

log = logging.getLogger(__name__)


class MtqErrorMiddleware(MiddlewareMixin):
    """Answers mtq's errors raised in views as JSON (see the module docstring)."""

    def process_exception(self, request: HttpRequest,
                          exception: Exception) -> HttpResponse | None:
        if not isinstance(exception, MtqError):  # BadLastEventId is one
            return None
        if http_error(exception) is None:  # not a client's or capacity error: a bug
            log.error("unexpected mtq error in %s", request.path, exc_info=exception)
        return error_response(exception)
