"""The documentation cannot drift from the tool (issue 42): README.md and docs/*.md are read here.

* Every ``elx`` command in a fenced ``bash`` block is parsed by elx's own argument parser (``elx.cli.build_parser``):
  a renamed or removed option, a subcommand that no longer exists or a value its type refuses fails this test.
  Placeholders (``DIR``, ``MODEL``) are plain arguments; synopses with ``[optional]`` brackets are fenced
  ``text``, not ``bash``.
* Synopses (fenced ``text``: ``elx SUBCOMMAND ... [--option N]``) name only options that subcommand has.
* Blocks fenced ``bash runnable`` / ``python runnable`` run, in order per file, in one temporary folder, and
  must exit 0.
* Every relative link between the pages points at a file that exists.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)


def blocks(page: Path) -> list[tuple[str, str]]:
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(page.read_text(encoding="utf-8"))]


def elx_commands(code: str) -> list[list[str]]:
    """The ``elx ...`` commands of a bash block: continuation lines joined, comments dropped, split at
    ``&&``, ``||``, ``;`` and ``|``."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        command = []
        for word in [*words, "&&"]:
            if word in ("&&", "||", ";", "|"):
                if command and command[0] == "elx":
                    out.append(command)
                command = []
            else:
                command.append(word)
    return out


def _all_commands():
    for page in PAGES:
        for info, code in blocks(page):
            if info.split()[:1] == ["bash"]:
                for command in elx_commands(code):
                    yield pytest.param(command, id=f"{page.name}:{' '.join(command)[:60]}")


COMMANDS = list(_all_commands())


def test_the_pages_have_commands():
    assert len(COMMANDS) >= 25 and len(PAGES) >= 10


@pytest.fixture(scope="module")
def parser():
    from elx.cli import build_parser

    return build_parser()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_documented_command_parses(command, parser, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a value read as a file (--generation-config) is looked up here
    try:
        parser.parse_args(command[1:])
    except SystemExit as stop:  # --help and --version exit 0; a refused option exits 2
        assert stop.code == 0, f"the docs' command does not parse: {' '.join(command)}"


def synopses() -> list[tuple[str, list[str], str]]:
    """(subcommand, the --options named, page) of each ``elx SUBCOMMAND`` line of the text blocks (indented
    continuation lines included)."""
    out = []
    for page in PAGES:
        for info, code in blocks(page):
            if info.split()[:1] != ["text"]:
                continue
            for line in code.splitlines():
                if line.startswith("elx "):
                    words = line.split()
                    out.append((words[1], re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line), page.name))
                elif line.startswith(" ") and out and line.strip().startswith(("[", "--")):
                    out[-1][1].extend(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line))
    return out


def test_synopses_name_options_that_exist(parser):
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    found = synopses()
    assert len(found) >= 8
    for command, options, page in found:
        assert command in subparsers, f"{page}: elx {command} is not a subcommand"
        known = {o for a in subparsers[command]._actions for o in a.option_strings}
        unknown = [o for o in options if o not in known]
        assert not unknown, f"{page}: elx {command} has no {', '.join(unknown)}"


def test_runnable_blocks_run(tmp_path):
    ran = 0
    for page in PAGES:
        for info, code in blocks(page):
            words = info.split()
            if "runnable" not in words[1:]:
                continue
            if words[0] == "bash":
                run = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, capture_output=True,
                                     text=True, timeout=600)
            else:
                assert words[0] == "python", f"{page.name}: runnable blocks are bash or python, not {words[0]}"
                run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                                     timeout=600)
            assert run.returncode == 0, f"{page.name}: a runnable block failed:\n{code}\n{run.stderr[-2000:]}"
            ran += 1
    assert ran >= 2


def test_links_between_pages_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
