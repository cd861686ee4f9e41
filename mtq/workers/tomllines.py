"""The line of every key of a TOML document, for error messages that name it
(``tomllib`` returns values without positions).

:func:`key_lines` reads a document that ``tomllib`` has already parsed (so it is
valid TOML) and maps each key's path to the line where the key is written: tables
by name, an array of tables by its index (``("engine", 1, "queue")`` is ``queue``
in the second ``[[engine]]``), an array's items by index. It follows table headers
(``[host]``, ``[[engine]]``, ``[engine.options]``), dotted keys
(``options.model = ...``), inline tables (``options = { model = "..." }``), arrays
of inline tables, and skips strings of every kind (a ``[[engine]]`` inside a
multi-line string is text, not a header) and comments.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping

Path = tuple[str | int, ...]

_BARE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


class _Scanner:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0
        self.starts = [0] + [k + 1 for k, ch in enumerate(text) if ch == "\n"]
        self.lines: dict[Path, int] = {}
        #: array of tables -> how many of its tables were opened so far
        self.arrays: dict[Path, int] = {}

    # -- positions -------------------------------------------------------------------
    def line(self, pos: int) -> int:
        return bisect.bisect_right(self.starts, pos)

    def record(self, path: Path, pos: int) -> None:
        self.lines.setdefault(path, self.line(pos))

    def peek(self, n: int = 1) -> str:
        return self.s[self.i:self.i + n]

    def skip_space(self, newlines: bool = False) -> None:
        """Spaces and tabs; with ``newlines``, line ends and comments too."""
        s = self.s
        while self.i < len(s):
            ch = s[self.i]
            if ch in " \t" or (newlines and ch in "\r\n"):
                self.i += 1
            elif newlines and ch == "#":
                self.skip_comment()
            else:
                return

    def skip_comment(self) -> None:
        end = self.s.find("\n", self.i)
        self.i = len(self.s) if end < 0 else end

    # -- strings and keys ------------------------------------------------------------
    def string(self) -> str:
        """A string of any of the four kinds at the cursor; returns its text (escapes
        left as written: keys that need them are not looked up)."""
        s = self.s
        quote = s[self.i]
        if s.startswith(quote * 3, self.i):
            start = self.i + 3
            j = start
            while True:
                j = s.find(quote * 3, j)
                if j < 0:  # pragma: no cover - tomllib accepted the document
                    self.i = len(s)
                    return s[start:]
                if quote == '"' and _escaped(s, j):
                    j += 1
                    continue
                break
            end = j + 3
            while end < len(s) and s[end] == quote and end - j < 5:  # """a"""" is 'a"'
                end += 1
            self.i = end
            return s[start:end - 3]
        start = self.i + 1
        j = start
        while j < len(s) and s[j] != quote:
            j += 2 if quote == '"' and s[j] == "\\" else 1
        self.i = j + 1
        return s[start:j]

    def key(self) -> list[str]:
        """A (dotted) key at the cursor; leaves the cursor after it."""
        parts: list[str] = []
        while True:
            self.skip_space()
            if self.peek() == '"':
                parts.append(_unescape(self.string()))
            elif self.peek() == "'":
                parts.append(self.string())
            else:
                start = self.i
                while self.i < len(self.s) and self.s[self.i] in _BARE:
                    self.i += 1
                parts.append(self.s[start:self.i])
            self.skip_space()
            if self.peek() != ".":
                return parts
            self.i += 1

    # -- values ----------------------------------------------------------------------
    def value(self, path: Path) -> None:
        ch = self.peek()
        if ch == "{":
            self.i += 1
            while True:
                self.skip_space(newlines=True)
                if self.peek() == "}":
                    self.i += 1
                    return
                if self.peek() == ",":
                    self.i += 1
                    continue
                self.pair(path)
        elif ch == "[":
            self.i += 1
            index = 0
            while True:
                self.skip_space(newlines=True)
                if self.peek() == "]":
                    self.i += 1
                    return
                if self.peek() == ",":
                    self.i += 1
                    continue
                self.record((*path, index), self.i)
                self.value((*path, index))
                index += 1
        elif ch in ('"', "'"):
            self.string()
        else:  # a number, a date, true or false: up to what ends a value
            s = self.s
            while self.i < len(s) and s[self.i] not in ",]}\r\n#":
                self.i += 1

    def pair(self, table: Path) -> None:
        """``key = value`` at the cursor, in ``table``."""
        start = self.i
        parts = self.key()
        for n in range(1, len(parts) + 1):
            self.record((*table, *parts[:n]), start)
        self.skip_space()
        self.i += 1  # "="
        self.skip_space()
        self.value((*table, *parts))

    def resolve(self, parts: list[str]) -> Path:
        """A header's key as a path: an array of tables met on the way is its last table."""
        path: Path = ()
        for part in parts:
            path = (*path, part)
            if path in self.arrays:
                path = (*path, self.arrays[path] - 1)
        return path

    def header(self) -> Path:
        """A ``[table]`` or ``[[array]]`` header at the cursor; returns the table it opens."""
        start = self.i
        array = self.s.startswith("[[", self.i)
        self.i += 2 if array else 1
        parts = self.key()
        self.i += 2 if array else 1
        if not array:
            path = self.resolve(parts)
            self.record(path, start)
            return path
        base = (*self.resolve(parts[:-1]), parts[-1])
        n = self.arrays.get(base, 0)
        self.arrays[base] = n + 1
        self.record(base, start)
        self.record((*base, n), start)
        return (*base, n)

    def run(self) -> dict[Path, int]:
        table: Path = ()
        while True:
            self.skip_space(newlines=True)
            if self.i >= len(self.s):
                return self.lines
            if self.peek() == "[":
                table = self.header()
            else:
                self.pair(table)


def _escaped(s: str, j: int) -> bool:
    """Whether the character at ``j`` is escaped (an odd run of backslashes before it)."""
    n = 0
    while j - n - 1 >= 0 and s[j - n - 1] == "\\":
        n += 1
    return n % 2 == 1


def _unescape(raw: str) -> str:
    """A basic string's text with its escapes read (JSON's are TOML's, but for
    ``\\UXXXXXXXX``: such a key keeps its escapes, and is found by its table)."""
    try:
        return str(json.loads(f'"{raw}"'))
    except ValueError:
        return raw


def key_lines(text: str) -> dict[Path, int]:
    """Path -> line (1-based) of every table and key of ``text``, a valid TOML document."""
    return _Scanner(text).run()


def line_of(lines: Mapping[Path, int], path: Path) -> int:
    """The line of ``path``, or of its nearest enclosing key or table that has one;
    0 when none has."""
    for n in range(len(path), 0, -1):
        found = lines.get(path[:n])
        if found:
            return found
    return 0
