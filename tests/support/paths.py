"""Where the repository is, and which interpreter runs the tests."""

from __future__ import annotations

import sys
from pathlib import Path

#: the repository root
ROOT = Path(__file__).resolve().parent.parent.parent
#: the interpreter running the tests (subprocesses use the same)
PY = sys.executable
