"""Who may act on the web dashboard: reading needs nothing, every action needs an admin
key, and forms are protected against cross-site requests (see docs/dashboard.md).

Interface used by the pages (:mod:`mtq.dashboard.web.app`):

* :func:`admin` -- the admin key behind a request (its session cookie, or an
  ``Authorization: Bearer`` header), or None;
* :func:`csrf_token` -- the value a form posted by that admin carries in its ``csrf``
  field ("" when no admin is signed in);
* :func:`routes` -- sign-in, sign-out and the actions, mounted at the dashboard's root.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.routing import BaseRoute


def admin(request: Request) -> Any | None:
    """The admin key behind ``request`` (an ApiKey with ``admin`` true), or None."""
    return None


def csrf_token(request: Request) -> str:
    """The CSRF token forms of this admin's session carry ("" without one)."""
    return ""


def routes() -> list[BaseRoute]:
    """POST /login, /logout and the actions (see the module docstring)."""
    return []
