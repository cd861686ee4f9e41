"""Return codes of the Lua scripts and their translation into exceptions."""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    """Negative codes a script returns (mirrors the E_* constants in lua/_lib.lua)."""

    QUEUE_FULL = -1
    DUPLICATE_ID = -2
    LEASE_LOST = -3
    NOT_FOUND = -4
    FINISHED = -5
    BAD_ARGUMENT = -6


def is_error(value: object) -> bool:
    """True if a script result entry is one of the negative codes."""
    return isinstance(value, int) and value < 0
