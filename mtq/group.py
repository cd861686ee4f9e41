"""Groups live in :mod:`mtq.client.group`; this module re-exports them for code that
imports ``mtq.group``."""

from mtq.client.group import Group, GroupQueue

__all__ = ["Group", "GroupQueue"]
