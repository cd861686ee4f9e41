"""The README's commands: each ``mtq`` line in the shell blocks of the README and
docs/*.md is a command click accepts (those not run by test_docs_run.py too), the
README's set-up installs extras that exist, and its quick start works for real
(a supervisor serving TinyGPT, ``mtq submit --follow``, ``mtq status``,
``mtq dashboard --once``, then Ctrl-C drains and nothing is left running)."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.support.cli_parse import parse_mtq
from tests.support.doc_commands import pages, split_comment
from tests.support.paths import ROOT
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)

README = (ROOT / "README.md").read_text()


def shell_lines(text: str) -> list[str]:
    """The command lines of the ```sh blocks (comments, tags included, dropped)."""
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.splitlines():
            code = split_comment(line)[0]
            if code.strip():
                lines.append(code)
    return lines


def test_setup_commands_install_extras_that_exist() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    setup = [line for line in shell_lines(README) if "pip install" in line]
    assert len(setup) >= 2, "the README's set-up has its two commands"
    for line in setup:
        for extra in re.findall(r"\.\[([\w,]+)\]", line):
            for name in extra.split(","):
                assert name in extras, f"README installs .[{name}], which pyproject lacks"
    assert "mtq demo" in setup[0], "the first command runs the demo"
    assert setup[1].endswith("python -m pytest -q"), "the second runs the suite"
    ci = (ROOT / ".ci" / "run").read_text()
    assert setup[1] in ci.splitlines(), ".ci/run runs exactly the README's test command"


def test_every_mtq_line_of_the_readme_and_docs_parses() -> None:
    docs = "".join(page.read_text() for page in pages())
    lines = [line for line in shell_lines(docs) if "mtq " in line]
    assert len(lines) >= 15
    for line in lines:
        argv = shlex.split(line, comments=True)
        argv = argv[argv.index("mtq"):] if "mtq" in argv else []
        for op in ("&&", ">", "|", ";"):  # the mtq part of a shell line
            if op in argv:
                argv = argv[:argv.index(op)]
        if argv:
            parse_mtq(argv, f"README/docs line {line!r}")


def test_the_quick_start_works(redis_url: str, qname: str, subprocess_env: dict[str, str],
                               tmp_path: Path) -> None:
    quick = README[README.index("## Quick start"):]
    lines = shell_lines(quick)[:4]
    argvs = [shlex.split(line, comments=True) for line in lines]
    assert [a[:2] for a in argvs] == [["mtq", "workers"], ["mtq", "submit"],
                                      ["mtq", "status"], ["mtq", "dashboard"]], lines

    def mtq(argv: list[str]) -> list[str]:  # the README's queue name -> this test's
        return [sys.executable, "-m", "mtq", *[qname if a == "chat" else a for a in argv[1:]],
                "--redis", redis_url]

    env = dict(subprocess_env, MTQ_HOME=str(tmp_path / "home"), COLUMNS="120")
    log = tmp_path / "workers.log"
    with open(log, "wb") as out:
        sup = subprocess.Popen(mtq(argvs[0]), env=env, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        wait_for(lambda: "ready on cpu" in log.read_text(), 60,
                 "the quick start's supervisor did not start its worker")
        follow = subprocess.run([*mtq(argvs[1]), "--timeout", "60"], env=env, capture_output=True,
                                text=True, timeout=90)
        assert follow.returncode == 0, follow.stderr
        assert "succeeded" in follow.stderr and len(follow.stdout.strip()) > 0
        status = subprocess.run(mtq(argvs[2]), env=env, capture_output=True, text=True,
                                timeout=30)
        assert status.returncode == 0 and qname in status.stdout, status.stdout
        frame = subprocess.run([*mtq(argvs[3]), "--once"], env=env, capture_output=True,
                               text=True, timeout=30)
        assert frame.returncode == 0 and qname in frame.stdout, frame.stdout + frame.stderr
        sup.send_signal(signal.SIGINT)  # "Ctrl-C drains"
        assert sup.wait(30) == 0, log.read_text()[-2000:]
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait(10)
