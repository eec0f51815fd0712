"""What the docs and the README cite exists: every ``gradpatch.*`` name, every ``gradpatch`` subcommand and
flag, every ``GRADPATCH*`` variable; every variable gradpatch reads is in the environment reference; the
README's links lead to files. (Links inside the site are checked by ``mkdocs build --strict``.)"""
from __future__ import annotations

import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md"] + sorted((ROOT / "docs").rglob("*.md"))
TEXT = {page.relative_to(ROOT).as_posix(): page.read_text(encoding="utf-8") for page in PAGES}
#: Files of the installed package, not Python names.
FILES = {"gradpatch.pth", "gradpatch.start"}
#: Names the docs describe ahead of the code that provides them; their snippets are marked not run. A name
#: here that exists is checked like any other.
PENDING: dict[str, str] = {}


def code_of(text: str) -> list[str]:
    """The code spans and fenced code blocks of a Markdown text."""
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    rest = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    return fenced + re.findall(r"`([^`\n]+)`", rest)


def cited_names() -> dict[str, str]:
    names = {}
    for page, text in TEXT.items():
        for code in code_of(text):
            for name in re.findall(r"(?<![\w./-])gradpatch(?:\.[A-Za-z_][A-Za-z0-9_]*)+", code):
                names.setdefault(name, page)
    return names


def resolve(name: str) -> object:
    from gradpatch.patching.catalogue import builtin_package

    builtin_package()  # gradpatch.patches, also from a source checkout
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(name)


def test_every_cited_gradpatch_name_exists():
    names = cited_names()
    assert {"gradpatch.apply", "gradpatch.differentiable", "gradpatch.testing"} <= set(names), sorted(names)
    missing = {}
    for name, page in sorted(names.items()):
        if name in FILES:
            continue
        try:
            resolve(name)
        except (ImportError, AttributeError) as error:
            if name not in PENDING:
                missing[name] = f"{page}: {error}"
    assert not missing, missing


def test_the_resolver_fails_on_a_name_that_does_not_exist():
    with pytest.raises(AttributeError):
        resolve("gradpatch.checkpointing.tradeoff.checkpoint_tradeoff")
    assert resolve("gradpatch.checkpointing.tradeoff.tradeoff").__name__ == "tradeoff"


def _help(argv: list[str]) -> str:
    from gradpatch import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main(argv)
    return out.getvalue()


def commands_of(text: str) -> list[str]:
    """Command lines: those of ``sh`` blocks, and code spans that start with ``gradpatch``."""
    lines = [line for block in re.findall(r"```(?:sh|bash|console)\n(.*?)```", text, re.S) for line in block.splitlines()]
    rest = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    return lines + [span for span in re.findall(r"`([^`\n]+)`", rest) if re.match(r"(\w+=\S+ )*gradpatch ", span)]


def cited_commands() -> list[tuple[str, str, list[str]]]:
    """``(page, subcommand, flags)`` for every ``gradpatch SUB ...`` command line; the flags are those
    before a bare ``--`` (the command ``run`` starts) and, for ``doctor``, before the script."""
    found = []
    for page, text in TEXT.items():
        for line in commands_of(text):
            line = re.sub(r"(^| )#.*", "", line)  # a shell comment
            if True:
                for match in re.finditer(r"(?<![\w./-])gradpatch((?: +-{1,2}[a-z][a-z-]*)*) +([a-z][a-z-]*)((?: +[^ `#]+)*)",
                                         line):
                    before, command, rest = match.group(1).split(), match.group(2), match.group(3).split()
                    flags = list(before)
                    for token in rest:
                        if token == "--" or token.startswith(("|", ";", "&&")):
                            break
                        if token.startswith("-"):
                            flags.append(token.split("=")[0])
                        elif command == "doctor":
                            break
                    found.append((page, command, flags))
    return found


def test_every_cited_subcommand_and_flag_exists():
    commands = cited_commands()
    assert {c for _, c, _ in commands} >= {"run", "doctor", "list", "status", "tradeoff"}, commands
    top = _help(["--help"])
    known = set(re.findall(r"^    ([a-z][a-z-]*) ", top.split("COMMAND", 2)[-1], re.M))
    wrong = []
    for page, command, flags in commands:
        if command not in known:
            wrong.append(f"{page}: gradpatch {command} (commands: {sorted(known)})")
            continue
        text = _help([command, "--help"]) + top
        wrong += [f"{page}: gradpatch {command} {flag}" for flag in flags if not re.search(rf"(?<![\w-]){flag}\b", text)]
    assert not wrong, wrong


def variables_read() -> set[str]:
    names = set()
    for path in (ROOT / "gradpatch").rglob("*.py"):
        names |= set(re.findall(r"\bGRADPATCH(?:_[A-Z]+)*\b", path.read_text(encoding="utf-8")))
    return names - {"GRADPATCH_"}


def test_every_variable_gradpatch_reads_is_in_the_reference_and_every_cited_one_exists():
    reference = TEXT["docs/reference/environment.md"]
    read = variables_read()
    assert {"GRADPATCH", "GRADPATCH_CHECKPOINT", "GRADPATCH_SCAN"} <= read
    assert not [v for v in read if f"`{v}`" not in reference], sorted(read)
    elsewhere = set(re.findall(r"\bGRADPATCH(?:_[A-Z]+)*\b", (ROOT / "Makefile").read_text()))
    for path in (ROOT / "tests").rglob("*.py"):
        elsewhere |= set(re.findall(r"\bGRADPATCH_TEST_ENV\b", path.read_text(encoding="utf-8")))
    pending = {"GRADPATCH_ADOPT"} - read  # with gradpatch.adopt
    cited = {v for text in TEXT.values() for v in re.findall(r"\bGRADPATCH(?:_[A-Z]+)*\b", text)}
    assert not cited - read - elsewhere - pending, sorted(cited - read - elsewhere)


def test_the_readmes_links_lead_to_files():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", TEXT["README.md"])
    assert len(links) > 10
    assert not [link for link in links if "://" not in link and not (ROOT / link).exists()], links


def test_the_changelog_names_this_version_and_the_build_reads_it_from_the_package():
    import gradpatch

    assert "## Unreleased" in TEXT["CHANGELOG.md"] and f"## {gradpatch.__version__} " in TEXT["CHANGELOG.md"]
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'dynamic = ["version"]' in pyproject and 'path = "gradpatch/__init__.py"' in pyproject
    assert "checkpoint_tradeoff" not in pyproject  # named a function that does not exist
