from dataclasses import dataclass

from django.utils.deprecation import MiddlewareMixin


@dataclass
class HeaderUser:
    """A logged-in user named by the ``X-User`` header (tests only: no auth tables)."""

    pk: str
    is_authenticated: bool = True


class HeaderUserMiddleware(MiddlewareMixin):
    def process_request(self, request):  # type: ignore[no-untyped-def]
        name = request.headers.get("X-User")
        if name:
            request.user = HeaderUser(name)
