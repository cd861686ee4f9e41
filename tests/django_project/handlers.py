"""A worker target of the Django tests: it reads the row its view wrote, from the
SQLite file, outside Django (another process, another connection)."""

from __future__ import annotations

import sqlite3
from typing import Any


def read_order(payload: dict[str, Any]) -> dict[str, Any]:
    """``{"item": ...}`` of order ``payload["order"]``, None if the row is not there."""
    con = sqlite3.connect(payload["db"], timeout=5)
    try:
        row = con.execute("SELECT item FROM mtq_test_order WHERE id = ?",
                          (payload["order"],)).fetchone()
    finally:
        con.close()
    return {"item": row[0] if row else None}
