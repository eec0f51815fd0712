"""The package's layout rules, checked on the source: no module imports or reads another module's
``_private`` name, none is over :data:`MAX_LINES` lines, and the patching package imports without a
cycle."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("gradpatch", "patches")
#: A namedtuple's public API, spelled with an underscore.
NAMEDTUPLE = {"_replace", "_fields", "_asdict", "_make", "_field_defaults"}
#: Files outside the patching engine that still break the rule, to be emptied as they are fixed.
KNOWN_ELSEWHERE: set[str] = set()
#: The most lines a module under gradpatch/ or patches/ may have.
MAX_LINES = 300


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "patches":  # shipped as gradpatch.patches
        parts[0:1] = ["gradpatch", "patches"]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def violations(path: Path) -> list[str]:
    """Where ``path`` imports or reads a ``_private`` name of another gradpatch module."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[str] = []
    aliases: set[str] = set()  # local names bound to a gradpatch module (or a name imported from one)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] not in OURS:
                continue
            for alias in node.names:
                if _private(alias.name) and module != me:
                    found.append(f"line {node.lineno}: from {module} import {alias.name}")
                aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in OURS:
                    continue
                if any(_private(part) for part in alias.name.split(".")) and alias.name != me:
                    found.append(f"line {node.lineno}: import {alias.name}")
                aliases.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in NAMEDTUPLE:
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _sources() -> list[Path]:
    return sorted(ROOT.glob("gradpatch/**/*.py")) + sorted(ROOT.glob("patches/*.py"))


def test_no_module_reads_another_modules_private_names():
    broken = {}
    for path in _sources():
        relative = path.relative_to(ROOT).as_posix()
        if relative not in KNOWN_ELSEWHERE and violations(path):
            broken[relative] = violations(path)
    assert not broken, broken


def test_no_module_is_over_the_line_limit():
    lines = {path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
             for path in _sources()}
    over = {path: count for path, count in lines.items() if count > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split out a cohesive piece): {over}"


def test_the_check_sees_each_form(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "gradpatch").mkdir()
    source = tmp_path / "gradpatch" / "mod.py"
    source.write_text("from gradpatch.patching.ledger import _lock\n"
                      "import gradpatch.doctor._watch\n"
                      "from gradpatch.patching import ledger as L\n"
                      "from gradpatch.patching.ledger import LEDGER\n"
                      "from gradpatch.patching.patch import Patch\n"
                      "L._wanted, LEDGER._lock, Patch._replace, Patch._fields\n"
                      "def _own(): pass\n_own()\n")
    assert [v.split(": ", 1)[1] for v in violations(source)] == [
        "from gradpatch.patching.ledger import _lock", "import gradpatch.doctor._watch", "L._wanted", "LEDGER._lock"]


def test_the_patching_engine_imports_without_a_cycle():
    for module in ("gradpatch.patching.activation", "gradpatch.patching.ledger", "gradpatch.patching.scan",
                   "gradpatch.patching.scripts", "gradpatch.doctor.diagnosis", "gradpatch.cli",
                   "gradpatch.patching.patch", "gradpatch.patching.import_time", "gradpatch.patching.unknown_code",
                   "gradpatch.doctor.findings", "gradpatch.cli_list"):
        done = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                              env={"PYTHONPATH": str(ROOT), "PATH": ""}, timeout=120)
        assert done.returncode == 0, (module, done.stderr)


FIRST_IMPORTS = """
import importlib, pkgutil, sys, warnings
import torch  # stays loaded: only gradpatch's own modules are imported afresh each time
import gradpatch
names = sorted(m.name for m in pkgutil.walk_packages(gradpatch.__path__, "gradpatch.")
               if not m.name.endswith("__main__"))
print(len(names))
for name in names:
    for loaded in [k for k in sys.modules if k == "gradpatch" or k.startswith("gradpatch.")]:
        del sys.modules[loaded]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(name)
    except Exception as error:
        print(name, type(error).__name__, error)
"""


def test_every_module_imports_first():
    """Each module of the package imported before any other of it (a cycle shows only in some orders)."""
    done = subprocess.run([sys.executable, "-c", FIRST_IMPORTS], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "", "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr
    count, *failed = done.stdout.splitlines()
    assert int(count) > 100 and not failed, failed


def test_the_old_registry_path_still_works_and_warns():
    saved = sys.modules.pop("gradpatch.patching.registry", None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            registry = importlib.import_module("gradpatch.patching.registry")
        patch = importlib.import_module("gradpatch.patching.patch")

        assert [w.category for w in caught] == [DeprecationWarning]
        assert "gradpatch.patching.patch" in str(caught[0].message)
        for name in ("Patch", "Record", "Report", "Status", "format_table", "elide", "WIDTH", "report_line"):
            assert getattr(registry, name) is getattr(patch, name)
    finally:
        sys.modules.pop("gradpatch.patching.registry", None)
        if saved is not None:
            sys.modules["gradpatch.patching.registry"] = saved
