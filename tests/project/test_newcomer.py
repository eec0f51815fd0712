"""A newcomer's first hour: the wheel in fresh virtual environments, the README's own commands and the code
of the README and of the docs pages whose blocks stand alone, and the first things a user meets (warnings,
the environment variables, trainable()). (tests/project/test_docs_snippets.py runs every page's blocks
in this test environment, against the output each shows.)

The slow tests build the wheel and install it, with the README's two-step commands for ``[audioldm]``
and ``[f5-tts]``, into fresh virtual environments. torch is not downloaded again: its files (and those
of its own dependencies) are hard-linked from this test environment into the new one, which is what
``pip install torch`` would unpack; everything else comes from pip, pinned by ``requirements/test.txt``
(so pip's cache, filled when the test environment was built, serves it).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from support import ROOT, run_python

README = (ROOT / "README.md").read_text(encoding="utf-8")
ACTIVATE = (ROOT / "docs" / "how-to" / "activate.md").read_text(encoding="utf-8")
#: The pages whose Python blocks each run on their own (the tutorials' blocks build on each other).
STANDALONE = ["README.md", "docs/concepts/checkpoint.md", "docs/how-to/memory.md", "docs/how-to/training-stack.md",
              "docs/how-to/differentiable-sampling.md", "docs/how-to/unknown-code.md", "docs/troubleshooting.md"]
WIDTH = 100


# --- the README, read as a newcomer reads it ----------------------------------------------------------

def readme_python_blocks() -> list[tuple[set[str], str]]:
    """``(needs, code)`` for every ```python block of the README and the STANDALONE pages; ``<!-- needs: a,
    b -->`` right before a block names the extras it needs (default: audioldm), ``<!-- not run: why -->``
    leaves it out."""
    blocks = []
    text = "\n".join((ROOT / page).read_text(encoding="utf-8") for page in STANDALONE)
    for comment, code in re.findall(r"(?:<!--(.*?)-->\n)?```python\n(.*?)```", text, re.S):
        comment = comment.strip()
        if comment.startswith("not run"):
            continue
        needs = {n.strip() for n in comment.partition("needs:")[2].split(",") if n.strip()} or {"audioldm"}
        blocks.append((needs, code))
    return blocks


def readme_install(extra: str) -> list[str]:
    """The arguments of the README's second, ``--no-deps`` command for ``extra`` (empty if none)."""
    (row,) = [line for line in README.splitlines() if line.startswith("|") and f'".[{extra}]"' in line]
    second = re.search(r"pip install --no-deps ([^`]+)`", row)
    return second.group(1).split() if second else []


def test_the_readme_says_how_to_install_and_what_reaches_spawn_workers():
    assert "## Install" in README and README.index("## Install") < README.index("## Turning it on")
    for extra in ("audioldm", "audioldm2", "f5-tts", "e2-tts", "diffusers"):
        assert f'pip install ".[{extra}]"' in README
    assert readme_install("audioldm") == ["audioldm==0.1.1", "torchaudio==2.11.0"]
    torch_floor = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert "gradpatch.testing" in README and f"torch {torch_floor} or later" in README  # as declared
    assert "**`apply()` in code patches only the process that runs it**" in ACTIVATE
    assert "spawn" in ACTIVATE[ACTIVATE.index("**`apply()` in code"):][:400]
    declared = re.findall(r"^([a-z0-9-]+) = \[", (ROOT / "pyproject.toml").read_text(), re.M)
    assert set(declared) >= {"audioldm", "audioldm2", "f5-tts", "e2-tts", "diffusers"}


def test_every_python_block_of_the_readme_runs_somewhere():
    blocks = readme_python_blocks()
    assert len(blocks) >= 6
    # The slow tests below run them: audioldm's in one environment, F5-TTS's and diffusers' in another.
    assert all(needs <= {"audioldm"} or needs <= {"f5-tts", "diffusers"} for needs, _ in blocks), blocks


def test_the_license_ships_and_the_sdist_holds_what_make_demo_and_the_tests_need(tmp_path):
    import tarfile
    import zipfile

    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 the gradpatch authors" in text
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--sdist", "--outdir", str(tmp_path),
                    str(ROOT)], check=True, capture_output=True, text=True)
    wheel = zipfile.ZipFile(next(tmp_path.glob("*.whl")))
    assert "gradpatch-0.1.0.dist-info/licenses/LICENSE" in wheel.namelist()
    assert "License-Expression: MIT" in wheel.read("gradpatch-0.1.0.dist-info/METADATA").decode()
    names = {n.split("/", 1)[1] for n in tarfile.open(next(tmp_path.glob("*.tar.gz"))).getnames() if "/" in n}
    assert {"LICENSE", "Makefile", "examples/finetune_audioldm.py", "requirements/test.txt",
            "requirements/upstream.txt", "tests/project/test_newcomer.py", "notebooks/audioldm_cross_attention.ipynb",
            ".ci/run"} <= names


# --- warnings: one each, pointing at the user's line ----------------------------------------------------

TWO_ON_ONE_MODULE = '''
from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.patch import Patch

def fix(original):
    return original

KNOWN = Fingerprints({"0" * 16: "not this code"})
PATCHES = [
    Patch("twin.checkpoint", "twin.util:checkpoint", "twinplugin:fix", KNOWN, "twin", "fix one"),
    Patch("twin.CheckpointFunction", "twin.util:CheckpointFunction", "twinplugin:fix", KNOWN, "twin", "fix two"),
]
'''


@pytest.fixture
def twin(tmp_path: Path) -> Path:
    """A target module with two patches on it whose code is unknown, and a user script importing it."""
    (tmp_path / "twin").mkdir()
    (tmp_path / "twin" / "__init__.py").write_text("")
    (tmp_path / "twin" / "util.py").write_text("def checkpoint(x):\n    return x\n\nclass CheckpointFunction:\n    pass\n")
    (tmp_path / "twinplugin.py").write_text(TWO_ON_ONE_MODULE)
    info = tmp_path / "twinplugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: twinplugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[gradpatch.patches]\ntwin = twinplugin\n")
    (tmp_path / "user.py").write_text("import gradpatch\ngradpatch.apply('twin', 'nosuch')\nimport twin.util\n")
    return tmp_path


def _warning_lines(stderr: str, category: str) -> list[str]:
    return [line for line in stderr.splitlines() if f": {category}: " in line]


def test_warnings_point_at_the_users_lines_once_per_module(twin):
    result = run_python("import runpy; runpy.run_path('user.py', run_name='__main__')", cwd=twin, pythonpath=[twin])
    assert result.returncode == 0, result.stderr
    unknown = _warning_lines(result.stderr, "UnknownCodeWarning")
    assert len(unknown) == 1, result.stderr  # two patches, one module: one warning
    assert unknown[0].startswith("user.py:3: ") and "twin.checkpoint, twin.CheckpointFunction" in unknown[0]
    config = _warning_lines(result.stderr, "ConfigWarning")
    assert len(config) == 1 and config[0].startswith("user.py:2: ") and "'nosuch'" in config[0]
    assert "wrapt" not in result.stderr and "importlib" not in result.stderr


def test_a_config_warning_is_not_repeated_by_import_gradpatch_auto(twin):
    (twin / "auto_user.py").write_text("import gradpatch.auto\nimport twin.util\n")
    result = run_python("import runpy; runpy.run_path('auto_user.py', run_name='__main__')", cwd=twin,
                        pythonpath=[twin], env={"GRADPATCH": "twin,nosuch"})
    assert result.returncode == 0, result.stderr
    assert len(_warning_lines(result.stderr, "ConfigWarning")) == 1, result.stderr
    assert len(_warning_lines(result.stderr, "UnknownCodeWarning")) == 1, result.stderr


@pytest.mark.parametrize("value", [",", " , ,"])
def test_a_gradpatch_value_naming_nothing_stays_off_and_says_so(fake_upstream, value):
    result = run_python("import fakeup, gradpatch; print(fakeup.checkpoint(1), len(gradpatch.report()))",
                        env={"GRADPATCH": value}, pythonpath=[fake_upstream])
    assert result.stdout.split() == ["2", "0"], result.stderr  # unpatched, nothing selected
    (warning,) = _warning_lines(result.stderr, "ConfigWarning")
    assert "names no patch, so gradpatch stays off" in warning


def test_log_info_shows_that_gradpatch_is_active_before_any_target(fake_upstream):
    result = run_python("pass", env={"GRADPATCH": "fakeup", "GRADPATCH_LOG": "info"}, pythonpath=[fake_upstream])
    assert "gradpatch: active (GRADPATCH=fakeup): 0 applied, 1 waiting for their targets to be imported" \
        in result.stderr, result.stderr


# --- trainable(): check first, then change ---------------------------------------------------------------

def test_trainable_refuses_an_include_typo_before_changing_anything():
    import torch

    import gradpatch

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].requires_grad_(False)
    before = [p.requires_grad for p in model.parameters()]
    with pytest.raises(ValueError, match=r"'\*atn2\*' matched no parameter .*nothing was changed"):
        gradpatch.trainable(model, include=["*atn2*"])
    with pytest.raises(ValueError, match=r"'1\.wieght'"):
        gradpatch.trainable(model, include=["0.*", "1.wieght"])  # one good pattern does not save the typo
    assert [p.requires_grad for p in model.parameters()] == before
    summary = gradpatch.trainable(model, include=["1.*"])
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True]
    assert summary.trained_tensors == 2


# --- the wheel in fresh virtual environments -----------------------------------------------------------

def _torch_closure() -> list:
    """pip's and torch's distributions and, recursively, those they require here (extras and markers
    honoured)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, object] = {}
    done: set[tuple[str, str]] = set()
    todo = [("torch", ""), ("pip", "")]
    while todo:
        name, extra = todo.pop()
        key = canonicalize_name(name)
        if (key, extra) in done:
            continue
        done.add((key, extra))
        try:
            dist = found.setdefault(key, distribution(name))
        except PackageNotFoundError:
            continue
        for text in dist.requires or ():
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                todo += [(requirement.name, "")] + [(requirement.name, e) for e in requirement.extras]
    return list(found.values())


def fresh_venv(path: Path) -> Path:
    """A new virtual environment holding pip and torch (hard-linked from this one: ensurepip alone takes
    5 to 15 s here) and nothing else."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"]).resolve()
    for dist in _torch_closure():
        root = Path(dist.locate_file("")).resolve()
        if root != ours:
            continue
        for file in dist.files or ():
            if file.parts[0] == "..":
                continue  # console scripts
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                try:
                    os.link(root / file, target)
                except OSError:
                    shutil.copy2(root / file, target)
    return python


def pip(python: Path, *args: str) -> None:
    # --no-compile: byte-compiling every installed file (scipy, numba, transformers...) would take longer
    # than the install; the modules the test imports are compiled when imported.
    result = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                             "--no-compile", *args], capture_output=True, text=True)
    output = result.stdout[-3000:] + result.stderr[-3000:]
    if result.returncode and any(sign in output for sign in _OFFLINE):
        pytest.skip(f"the package index cannot be reached and pip's cache lacks a wheel: {output.strip()[-300:]}")
    assert result.returncode == 0, output


# pip's words for an unreachable index (as opposed to a resolution or install failure, which must fail).
_OFFLINE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
            "Network is unreachable")


def run_in(python: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
           tool: str | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADPATCH", "PYTHON", "VIRTUAL_ENV"))}
    full_env.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})})
    command = [str(python.with_name(tool))] if tool else [str(python)]
    return subprocess.run(command + list(args), capture_output=True, text=True, env=full_env, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True, text=True)
    return next(out.glob("*.whl"))


def install_extra(tmp_path: Path, wheel: Path, extra: str) -> tuple[Path, dict[str, float]]:
    """A fresh venv with ``wheel[extra]`` installed as the README says; seconds each step took."""
    times = {}
    started = time.perf_counter()
    python = fresh_venv(tmp_path / f"venv-{extra}")
    times["venv with torch"] = time.perf_counter() - started
    pip(python, "-c", str(ROOT / "requirements" / "test.txt"), f"{wheel}[{extra}]")
    times[f"[{extra}]"] = time.perf_counter() - started - sum(times.values())
    second = readme_install(extra)
    if second:
        pip(python, "--no-deps", *second)
    times["--no-deps step"] = time.perf_counter() - started - sum(times.values())
    return python, times


def run_readme_blocks(python: Path, tmp_path: Path, available: set[str]) -> int:
    ran = 0
    for index, (needs, code) in enumerate(readme_python_blocks()):
        if not needs <= available:
            continue
        result = run_in(python, "-c", code, cwd=tmp_path)
        assert result.returncode == 0, f"README python block {index} failed:\n{code}\n{result.stderr[-3000:]}"
        ran += 1
    return ran


AUDIOLDM_STEP = """
import json, torch, gradpatch
from gradpatch.testing import audioldm_batch, audioldm_unet
model = audioldm_unet()
gradpatch.trainable(model, include=["*attn2*"])
batch = audioldm_batch()
torch.nn.functional.mse_loss(model(batch["x"], timesteps=batch["timesteps"], y=batch["y"]), batch["target"]).backward()
print(json.dumps([[r.patch, r.status.value] for r in gradpatch.report() if r.upstream == "audioldm"]
                 + [all(p.grad is not None for p in model.parameters() if p.requires_grad)]))
"""


@pytest.mark.slow
def test_audioldm_extra_gives_a_working_environment_and_the_cli_a_newcomer_meets(wheel, tmp_path):
    python, times = install_extra(tmp_path, wheel, "audioldm")

    version = run_in(python, "--version", tool="gradpatch")
    assert version.returncode == 0 and version.stdout.startswith("gradpatch 0.1.0 from ")
    assert str(python.parent.parent) in version.stdout  # the installed copy, not the checkout
    bare = run_in(python, tool="gradpatch")
    assert bare.returncode == 0 and "usage: gradpatch" in bare.stdout and "required" not in bare.stderr
    for command in (["list"], ["status"]):
        result = run_in(python, *command, tool="gradpatch")
        assert result.returncode == 0, result.stderr
        assert max(map(len, result.stdout.splitlines())) <= WIDTH
    status = json.loads(run_in(python, "status", "--json", tool="gradpatch").stdout)
    row = next(r for r in status if r["patch"] == "audioldm.checkpoint")
    assert row["version"] == "0.1.1" and row["code"].startswith("known: V1")

    # The extras check: upstream audioldm imports, and its frozen-parameter step works under GRADPATCH=1.
    step = run_in(python, "-c", AUDIOLDM_STEP, env={"GRADPATCH": "1"}, cwd=tmp_path)
    assert step.returncode == 0, step.stderr[-3000:]
    *records, all_grads = json.loads(step.stdout.strip().splitlines()[-1])
    assert records[:2] == [["audioldm.checkpoint", "applied"], ["audioldm.CheckpointFunction", "applied"]]
    assert all(status == "applied" for _, status in records), records  # its samplers too
    assert all_grads
    report = run_in(python, "-c", "import gradpatch, audioldm; print(gradpatch.report().table('audioldm')); "
                    "print(gradpatch.report())",
                    env={"GRADPATCH": "1"}, cwd=tmp_path)
    lines = report.stdout.splitlines()
    assert max(map(len, lines)) <= WIDTH and "audioldm.checkpoint" in report.stdout
    assert "f5_tts.sample" not in report.stdout and "deferred for packages not installed here" in lines[-1]

    started = time.perf_counter()
    assert run_readme_blocks(python, tmp_path, {"audioldm"}) >= 4
    times["README blocks"] = time.perf_counter() - started
    print("seconds:", json.dumps({k: round(v, 1) for k, v in times.items()}))


F5_STEP = """
import json, torch, gradpatch
from gradpatch.testing import f5_cfm, f5_inputs
model = f5_cfm()
cond, text = f5_inputs()
out, _ = model.sample(cond, text, duration=12, steps=2, cache=False)
out.sum().backward()
print(json.dumps([[r.patch, r.status.value] for r in gradpatch.report() if r.upstream == "f5_tts"]
                 + [sum(p.grad is not None for p in model.parameters())]))
"""


@pytest.mark.slow
def test_f5_tts_extra_gives_a_working_environment(wheel, tmp_path):
    python, times = install_extra(tmp_path, wheel, "f5-tts")
    step = run_in(python, "-c", F5_STEP, env={"GRADPATCH": "1"}, cwd=tmp_path)
    assert step.returncode == 0, step.stderr[-3000:]
    *records, with_grad = json.loads(step.stdout.strip().splitlines()[-1])
    assert records == [["f5_tts.sample", "applied"]] and with_grad > 0

    started = time.perf_counter()
    pip(python, "-c", str(ROOT / "requirements" / "test.txt"), f"{wheel}[f5-tts,diffusers]")
    times["[diffusers] added"] = time.perf_counter() - started
    started = time.perf_counter()
    assert run_readme_blocks(python, tmp_path, {"f5-tts", "diffusers"}) >= 2
    times["README blocks"] = time.perf_counter() - started
    print("seconds:", json.dumps({k: round(v, 1) for k, v in times.items()}))
