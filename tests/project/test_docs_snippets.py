"""Every Python block of the docs and the README runs, and prints what the page shows it printing.

Per page, the blocks run in order in one fresh interpreter and one namespace (a reader goes through a
page top to bottom), each against the ``text`` block that follows it, if any: ``...`` there stands for
any text (as doctest's ELLIPSIS), trailing spaces are ignored. ``<!-- not run: why -->`` right before a
block leaves it out (the reason names what runs it instead); ``<!-- needs: ... -->`` (the extras the
README's blocks need in tests/project/test_newcomer.py's fresh environments) is ignored here, where
every upstream package is installed. Every block that runs shows its output (a block that prints nothing
would show the reader nothing to compare with).

``python tests/project/test_docs_snippets.py PAGE.md`` prints what each block of a page prints, to
write its output blocks.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(?:<!--(?P<comment>[^>]*)-->\n)?```python\n(?P<code>.*?)```[ \t]*\n"
                   r"(?:\s*```text\n(?P<output>.*?)```)?", re.S)


def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def blocks(page: Path) -> list[tuple[str, str | None]]:
    """``(code, shown output or None)`` of every block of ``page`` that runs."""
    found = []
    for match in BLOCK.finditer(page.read_text(encoding="utf-8")):
        if (match.group("comment") or "").strip().startswith("not run"):
            continue
        found.append((match.group("code"), match.group("output")))
    return found


HARNESS = r'''
import contextlib, io, json, linecache, sys, traceback, types
blocks = json.loads(sys.stdin.read())
main = sys.modules["__main__"] = types.ModuleType("__main__")  # the page's own __main__, apart from this loop's names
namespace = main.__dict__
printed = []
for index, code in enumerate(blocks):
    name = f"<{PAGE} block {index + 1}>"
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # tracebacks and inspect read it
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, name, "exec"), namespace)
    except BaseException:
        printed.append(out.getvalue())
        sys.__stdout__.write(json.dumps({"printed": printed, "error": traceback.format_exc()}))
        raise SystemExit(0)
    printed.append(out.getvalue())
sys.__stdout__.write(json.dumps({"printed": printed, "error": None}))
'''


def run_page(page: Path, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPATCH")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", COLUMNS="100")
    code = [c for c, _ in blocks(page)]
    relative = page.relative_to(ROOT).as_posix()
    result = subprocess.run([sys.executable, "-c", HARNESS.replace("{PAGE}", relative)], input=json.dumps(code),
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def matches(shown: str, printed: str) -> bool:
    normal = lambda text: "\n".join(line.rstrip() for line in text.strip("\n").splitlines())  # noqa: E731
    pattern = "".join("[\\s\\S]*?" if part == "..." else re.escape(part)
                      for part in re.split(r"(\.\.\.)", normal(shown)))
    return re.fullmatch(pattern, normal(printed)) is not None


RUN = [page for page in pages() if blocks(page)]


def test_every_block_that_runs_shows_its_output():
    assert not [(page.name, code[:60]) for page in RUN for code, shown in blocks(page) if shown is None]


def test_the_pages_hold_blocks_to_run():
    names = {page.relative_to(ROOT).as_posix() for page in RUN}
    assert {"README.md", "docs/tutorials/audioldm-cross-attention.md", "docs/tutorials/f5-reward-lora.md",
            "docs/tutorials/unknown-code.md"} <= names, names


def test_the_checker_reads_ellipses():
    assert matches("loss 1.2 -> ...\ndone", "loss 1.2 -> 0.9  \ndone\n")
    assert matches("a\n...\nz", "a\nb\nc\nz")
    assert not matches("a\nz", "a\nb\nz") and not matches("loss 1.2", "loss 1.3")


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN, ids=[p.relative_to(ROOT).as_posix() for p in RUN])
def test_every_python_block_runs_and_prints_what_the_page_shows(page, tmp_path):
    result = run_page(page, tmp_path)
    for index, ((code, shown), printed) in enumerate(zip(blocks(page), result["printed"]), 1):
        where = f"{page.relative_to(ROOT)} block {index}:\n{code}"
        assert shown is not None, f"{where}\nshows no output: add a ```text block with what it prints:\n{printed}"
        assert matches(shown, printed), f"{where}\nthe page shows:\n{shown}\nit printed:\n{printed}"
    assert result["error"] is None, f"{page.relative_to(ROOT)} block {len(result['printed'])} raised:\n" \
                                    f"{result['error']}"


if __name__ == "__main__":  # what each block of a page prints
    import tempfile

    for argument in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as folder:
            outcome = run_page(Path(argument).resolve(), Path(folder))
        for number, text in enumerate(outcome["printed"], 1):
            print(f"--- block {number}\n{text}", end="")
        if outcome["error"]:
            print(f"--- error\n{outcome['error']}")
