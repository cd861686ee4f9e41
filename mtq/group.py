"""Groups now live in :mod:`mtq.client.group`; this module re-exports them under the
old path."""

from mtq.client.group import Group, GroupQueue

__all__ = ["Group", "GroupQueue"]
