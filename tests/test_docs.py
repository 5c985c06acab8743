"""The README and docs/ stay true to the tree: their links lead somewhere, their commands parse.

Two checks, both in seconds and without loading a model:
- every relative link in README.md and docs/*.md names a file that exists (an #anchor after it is not checked);
- every `python -m engine <sub> ...` shown in a code block or code span: `python -m engine <sub> --help` exits 0
  and lists every flag the documented command uses. A renamed or removed option fails here, not in a newcomer's
  terminal.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)  # a code span may wrap onto the next line
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
COMMAND = re.compile(r"python -m engine(?![.\w])")  # not `python -m engine.forge.pays`, a module of its own
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SHELL_END = re.compile(r"\s(?:[|;>]|&&|\|\|)\s|$")  # where one command ends inside a line


def relative(page: Path) -> str:
    return str(page.relative_to(ROOT))


def prose(text: str) -> str:
    """The page without its fenced code blocks (a link inside one is code, not a link)."""
    return FENCE.sub("", text)


def links(page: Path) -> list[str]:
    text = SPAN.sub("", prose(page.read_text(encoding="utf-8")))
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def is_relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) and not target.startswith(("#", "//"))


def code(page: Path) -> list[str]:
    """Fenced blocks, with backslash-continued lines joined, then every code span of the prose."""
    text = page.read_text(encoding="utf-8")
    blocks = [m.group(0).split("\n", 1)[1].rsplit("\n", 1)[0] for m in FENCE.finditer(text)]
    blocks = [re.sub(r"\\\n\s*", " ", block) for block in blocks]
    spans = [re.sub(r"\s+", " ", m.group(2)) for m in SPAN.finditer(prose(text))]
    return blocks + spans


def commands(page: Path) -> list[str]:
    """Every documented `python -m engine ...` command, one per string."""
    found = []
    for chunk in code(page):
        for line in chunk.splitlines():
            for start in COMMAND.finditer(line):
                rest = line[start.start():]
                found.append(rest[: SHELL_END.search(rest, len(start.group(0))).start()].strip())
    return found


def invocation(command: str) -> tuple[list[str], str]:
    """(the module and subcommand to ask for --help, the part of the command whose flags must exist)."""
    words = command.split()
    if len(words) > 3 and not words[3].startswith("-"):
        return ["engine", words[3]], " ".join(words[4:])
    return ["engine"], " ".join(words[3:])  # the tool named alone


@lru_cache(maxsize=None)
def helps(keys: tuple[tuple[str, ...], ...]) -> dict[tuple[str, ...], tuple[int, str]]:
    """`python -m engine [sub] --help` for each key, run side by side (each imports torch: ~1 s apiece)."""
    runs = {
        key: subprocess.Popen([sys.executable, "-m", *key, "--help"], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for key in keys
    }  # fmt: skip
    return {key: (run.wait(timeout=120), run.stdout.read()) for key, run in runs.items()}


def documented() -> list[tuple[str, str]]:
    return [(relative(page), command) for page in PAGES for command in commands(page)]


def flags_of(args: str) -> set[str]:
    """Flags a command passes; quoted arguments (a prompt) are values, not flags."""
    try:
        words = shlex.split(args)
    except ValueError:  # an unbalanced quote in a shortened example: fall back to whitespace
        words = args.split()
    return {m.group(0) for word in words if word.startswith("--") for m in [FLAG.match(word)] if m}


def listed(flag: str, help_text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def test_the_docs_exist_and_name_what_they_check():
    assert (ROOT / "docs").is_dir() and len(PAGES) > 1
    assert sum(len(links(page)) for page in PAGES) >= 10, "the link check found almost no links: is the regex right?"
    assert len(documented()) >= 10, "the command check found almost no commands: is the regex right?"


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_every_relative_link_points_at_a_file_that_exists(page):
    missing = []
    for target in links(page):
        if not is_relative(target):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{relative(page)} links to files that do not exist: {missing}"


def test_every_documented_command_parses_and_uses_only_flags_it_has():
    commands = documented()
    keys = tuple(sorted({tuple(invocation(command)[0]) for _, command in commands}))
    outputs = helps(keys)
    problems = []
    for where, command in commands:
        key, args = invocation(command)
        rc, text = outputs[tuple(key)]
        if rc != 0:
            problems.append(f"{where}: `python -m {' '.join(key)} --help` exited {rc}: {text.strip()[-300:]}")
            continue
        unknown = sorted(flag for flag in flags_of(args) if not listed(flag, text))
        if unknown:
            problems.append(f"{where}: `{command}` uses {unknown}, which `python -m {' '.join(key)} --help` lacks")
    assert not problems, "\n".join(problems)
