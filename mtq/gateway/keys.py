"""The API keys, at the path the gateway first gave them: they live in
:mod:`mtq.client.apikeys` (the gateway and the web dashboard both use them)."""

from __future__ import annotations

from mtq.client.apikeys import (
    NAME_MAX,
    ApiKey,
    admit,
    any_keys,
    authenticate,
    create,
    list_keys,
    revoke,
)

__all__ = ["NAME_MAX", "ApiKey", "admit", "any_keys", "authenticate", "create", "list_keys",
           "revoke"]
