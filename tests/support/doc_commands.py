"""The shell commands of README.md and docs/*.md: every line of their ```sh blocks,
with the tag its trailing comment may carry (the convention is in docs/cli.md,
"Commands in these docs"; tests/integration/test_docs_run.py runs them).

    mtq workers start examples.tiny:TinyClassifier --queue tiny   # runs: service
    docker compose run --rm dashboard                            # needs: docker
    python -m pip install -e '.[dev]'                            # not run: installs
    mtq task no-such-task                                        # exits: 3

Text after a tag is free (``# runs: service; Ctrl-C drains``). A comment without a
tag (``# the queues``) changes nothing: the line runs and must exit 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

#: the tags, and what the word after ``needs:`` / ``not run:`` may be
TAG = re.compile(r"^(?P<kind>runs|needs|not run|exits):\s*(?P<value>[\w-]+)\b")
#: a comment that starts like a tag must be one (a misspelt tag would run the line)
TAG_LIKE = re.compile(r"^(runs?|running|needs?|not[ -]?run|skip\w*|exits?)\b", re.I)
NEEDS = ("gpu", "docker", "zsh")
NOT_RUN = ("installs",)


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def split_comment(line: str) -> tuple[str, str]:
    """``(code, comment)`` of a shell line: the comment is what follows a ``#`` that
    starts a word outside quotes (as the shell reads it), without the ``#``."""
    quote = ""
    i = 0
    while i < len(line):
        ch = line[i]
        if ch == "\\" and quote != "'":
            i += 2  # an escaped character, in double quotes or outside any
            continue
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
        i += 1
    return line.rstrip(), ""


@dataclass(frozen=True)
class Command:
    """One command line of a page's ```sh block."""

    page: str            # relative to the repository root
    lineno: int          # 1-based, in the page
    code: str            # the line without its comment
    comment: str
    kind: str = ""       # the tag: runs / needs / not run / exits, or "" for none
    value: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.lineno}"

    @property
    def service(self) -> bool:
        return (self.kind, self.value) == ("runs", "service")

    @property
    def skipped(self) -> bool:
        """Never run by the tests (a service may be started, see test_docs_run)."""
        return self.kind in ("needs", "not run")

    @property
    def exit_code(self) -> int:
        return int(self.value) if self.kind == "exits" else 0


def tag_problem(cmd: Command) -> str | None:
    """What is wrong with the command's tag, or None."""
    if not cmd.kind:
        if TAG_LIKE.match(cmd.comment):
            return (f"{cmd.where}: the comment {cmd.comment!r} looks like a tag but is not "
                    "one (runs: service, needs: gpu|docker|zsh, not run: installs, exits: N)")
        return None
    allowed = {"runs": ("service",), "needs": NEEDS, "not run": NOT_RUN}.get(cmd.kind)
    if allowed is not None and cmd.value not in allowed:
        return f"{cmd.where}: unknown tag '{cmd.kind}: {cmd.value}' (known: {allowed})"
    if cmd.kind == "exits" and not cmd.value.isdigit():
        return f"{cmd.where}: 'exits:' takes a number, got {cmd.value!r}"
    return None


def commands(page: Path) -> list[Command]:
    """The command lines of the page's ```sh blocks, in order (blank lines and lines
    that are only a comment left out)."""
    text = page.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"^```sh\n(.*?)^```", text, re.S | re.M):
        first = text.count("\n", 0, m.start(1)) + 1
        for offset, line in enumerate(m.group(1).splitlines()):
            code, comment = split_comment(line)
            if not code.strip():
                continue
            tag = TAG.match(comment)
            out.append(Command(str(page.relative_to(ROOT)), first + offset, code, comment,
                               tag["kind"] if tag else "", tag["value"] if tag else ""))
    return out
