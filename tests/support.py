"""Shared test helpers (fixtures live in ``conftest.py``). Import-order tests run in fresh interpreters
(``run_python``)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent  # the repository


def run_python(code: str, *, env: dict[str, str] | None = None, cwd: Path | None = None,
               pythonpath: list[Path] = (), timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this environment (so gradpatch.pth is active)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPATCH")}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join([str(p) for p in pythonpath] + [full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def last_json(result: subprocess.CompletedProcess) -> object:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


#: The start of a torch.compile test script (fresh interpreters): ``Block(width)`` checkpoints its body
#: through gradpatch's checkpoint; ``backend`` is ``aot_eager`` noting in ``graphs``, per graph dynamo
#: hands over, the torch checkpoints in it (one per recomputed block). Seeded: the script builds its models.
COMPILED_BLOCKS = '''
import json, warnings
import torch, torch.nn as nn
from torch._dynamo.backends.debugging import aot_eager
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from gradpatch import settings
from gradpatch.checkpointing import budget
from gradpatch.checkpointing.budget import checkpoint_plan
from gradpatch.checkpointing.checkpoint import checkpoint

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, width), nn.Linear(width, 8)
    def forward(self, x):
        return checkpoint(self._forward, (x,), self.parameters(), True)
    def _forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))

graphs = []

def backend(gm, inputs):
    graphs.append(sum(n.target is torch.ops.higher_order.tag_activation_checkpoint for n in gm.graph.nodes))
    return aot_eager(gm, inputs)

def grads(run):  # of the script's `model` on its `x`
    model.zero_grad(set_to_none=True)
    run(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]

def worst(errors, want):
    """The largest difference of any run's gradients from ``want``, and the largest of ``want``."""
    return (max((a - b).abs().max().item() for g in errors for a, b in zip(g, want)),
            max(b.abs().max().item() for b in want))

torch.manual_seed(0)
'''


#: A block that checkpoints its body through ``{module}``'s OpenAI/CompVis ``checkpoint``, as upstream
#: blocks do (written next to copies of that code in import tests).
CHECKPOINTED_BLOCK = '''
import torch
from torch import nn
from {module} import checkpoint


class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.norm, self.proj, self.out = nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return checkpoint(self._forward, (x,), self.parameters(), True)

    def _forward(self, x):
        return x + self.out(torch.relu(self.proj(self.norm(x))))
'''

#: Code for a fresh interpreter: ``step(block_module)`` runs a :data:`CHECKPOINTED_BLOCK` (``torch`` imported).
BLOCK_STEP = '''
def step(block_module):
    """True if gradients through the block equal those of its body without checkpointing; else
    upstream's error."""
    block = block_module.Block()
    block.norm.requires_grad_(False)
    trainable = [p for p in block.parameters() if p.requires_grad]
    x = torch.randn(3, 8)
    def grads(run):
        return torch.autograd.grad(run(x).square().mean(), trainable)
    try:
        got = grads(block)
    except RuntimeError as exc:
        return str(exc)
    want = grads(block._forward)
    return all(torch.allclose(g, w, rtol=1e-5, atol=1e-8) for g, w in zip(got, want))
'''

FAKE_UTIL = '''
def checkpoint(x):
    """A stand-in for a known-broken function."""
    return x + 1
'''

FAKE_PLUGIN = '''
from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.patch import Patch

def fix(original):
    def checkpoint(x):
        return original(x) + 100
    return checkpoint

def broken_fix(original):
    raise RuntimeError("this fix is broken")

PATCHES = [
    Patch("fakeup.checkpoint", "fakeup.util:checkpoint", "fakeplugin:fix",
          Fingerprints({"%(known)s": "fake V1"}), "fakeup", "adds 100", "fakeup>=1,<2"),
    Patch("fakebroken.checkpoint", "fakebroken.util:checkpoint", "fakeplugin:broken_fix",
          Fingerprints({"%(known)s": "fake V1"}), "fakebroken", "raises"),
    Patch("fakeother.checkpoint", "fakeother.util:checkpoint", "fakeplugin:fix",
          Fingerprints({"%(known)s": "fake V1"}), "fakeother", "adds 100"),
]
'''


# --- released upstream versions from PyPI, installed --no-deps into a cache shared across runs ------

CACHE = Path(os.environ.get("GRADPATCH_TEST_CACHE", Path.home() / ".cache" / "gradpatch-tests"))
_PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]


def _pip_into(folder: Path, commands: list[list[str]], timeout: float) -> Path | str:
    """Run pip commands into a fresh staging folder, then move it to ``folder``; or say why not."""
    if (folder / ".complete").exists():
        return folder
    CACHE.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=CACHE))
    for args in commands:
        try:
            done = subprocess.run(_PIP + [a.replace("{dest}", str(staging)) for a in args],
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            done = None
        if done is None or done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            why = "timed out" if done is None else (done.stderr.strip().splitlines() or ["?"])[-1]
            return f"cannot get {' '.join(a for a in args if '==' in a)} from the package index: {why}"
    (staging / ".complete").touch()
    try:
        staging.rename(folder)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def pypi_release(requirement: str, *extra: str) -> Path | str:
    """``requirement`` (and ``extra`` packages) installed ``--no-deps`` into a cached folder for
    ``PYTHONPATH``; or why that failed (tests skip with it)."""
    return _pip_into(CACHE / requirement.replace("==", "-"),
                     [["install", "--no-deps", "--timeout", "20", "--retries", "1", "--target", "{dest}",
                       requirement, *extra]], timeout=300)


def pypi_wheels(name: str, versions: list[str]) -> list[Path] | str:
    """The wheels of ``name`` at ``versions`` (no dependencies), downloaded once into the cache."""
    download = ["download", "--no-deps", "--only-binary", ":all:", "--timeout", "20", "--retries", "1",
                "--dest", "{dest}"]
    folder = _pip_into(CACHE / f"{name}-wheels-{len(versions)}",
                       [download + [f"{name}=={v}"] for v in versions], timeout=120)
    return folder if isinstance(folder, str) else sorted(folder.glob("*.whl"))


class BackgroundCheck:
    """Runs ``script`` once, in an interpreter of its own, on released versions installed from PyPI.

    ``releases`` maps a key to a thunk returning the installed folder (or why it could not be had);
    the script receives ``{key: folder}`` as JSON in argv[1] and prints ``{key: result}`` as JSON.
    Started early (it mostly imports, so it overlaps well with other tests), read on first use.
    """

    def __init__(self, script: str, releases: dict) -> None:
        self.script, self.releases = script, releases
        self.process, self.roots, self.results = None, {}, None

    def start(self) -> None:
        if self.process is not None or self.results is not None:
            return
        self.roots = {key: get() for key, get in self.releases.items()}
        ready = {k: str(v) for k, v in self.roots.items() if isinstance(v, Path)}
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPATCH")}
        env["HF_HUB_OFFLINE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])  # release_check
        self.process = subprocess.Popen([sys.executable, "-c", self.script, json.dumps(ready)], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self, key: str) -> tuple[Path, dict]:
        self.start()
        if self.results is None:
            out, err = self.process.communicate(timeout=600)
            assert self.process.returncode == 0, err[-3000:]
            self.results = json.loads(out.strip().splitlines()[-1])
        root = self.roots[key]
        if isinstance(root, str):
            pytest.skip(root)
        result = self.results[key]
        assert "error" not in result, result.get("error")
        return root, result

    @classmethod
    def fixture(cls, request, script: str, releases: dict):
        """Generator body for a module fixture: starts now when the module's slow tests are selected
        (under xdist, on first use), kills the interpreter at teardown."""
        check = cls(script, releases)
        if not os.environ.get("PYTEST_XDIST_WORKER") and any(
                item.module is request.module and item.get_closest_marker("slow") for item in request.session.items):
            check.start()
        yield check
        if check.process is not None and check.process.poll() is None:
            check.process.kill()
            check.process.communicate()


class Interleaved:
    """Two threads in a fixed order: "A" runs until it calls :meth:`pause` (its first call only), then
    "B" runs to its end, then A goes on. For a sampling call that must not disturb another one running
    at the same time (A holds its shadows on the model while B runs)."""

    def __init__(self) -> None:
        self.inside, self.b_done = threading.Event(), threading.Event()

    def pause(self, *_: object) -> None:
        """Call from A's code; also a forward pre-hook (``module, args``) that only A's thread obeys."""
        if threading.current_thread().name == "A" and not self.inside.is_set():
            self.inside.set()
            assert self.b_done.wait(60)

    def run(self, run_a, run_b) -> None:
        def b() -> None:
            assert self.inside.wait(60)
            run_b()
            self.b_done.set()

        threads = [threading.Thread(target=run_a, name="A"), threading.Thread(target=b, name="B")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)


def upstream_method(cls: type, name: str) -> object:
    """``cls.name`` as upstream defines it, under any gradpatch wrapper currently installed."""
    method = vars(cls)[name]
    while getattr(method, "__module__", "").startswith("gradpatch"):
        method = method.__wrapped__
    return method


def weighted_grads(out, tensors) -> list:
    """Gradients of a fixed random weighting of ``out`` (seeded, the same for every call with that shape)
    with respect to ``tensors``; ``None`` for a tensor the output does not depend on."""
    import torch

    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    return list(torch.autograd.grad((out * weight).sum(), list(tensors), allow_unused=True))


def assert_grads_close(got, want, rtol: float = 1e-4) -> None:
    """Two sequences of gradients (``None`` where a tensor got none): ``None`` in the same places, and
    the others equal to ``rtol``, near-zero entries against a floor scaled to the largest gradient."""
    import torch

    assert [g is None for g in got] == [w is None for w in want]
    floor = 1e-6 * max(w.abs().max().item() for w in want if w is not None)
    for g, w in zip(got, want):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=rtol, atol=floor)


def assert_grads_equal(got, want) -> None:
    """Two sequences of gradients: equal length, all finite, equal to rtol 1e-5."""
    import torch

    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-8)


def memtracker_peak(model, step, tracker=None) -> int:
    """The peak of ``step()`` by torch's ``MemTracker`` (the independent memory measure on CPU), above what it
    tracked when the step began; ``tracker``: a MemTracker (subclass) instance to use instead."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model.zero_grad(set_to_none=True)
    tracker = MemTracker() if tracker is None else tracker
    tracker.track_external(model)

    def total(kind: str) -> int:
        return sum(d.get("Total", 0) for d in tracker.get_tracker_snapshot(kind).values())

    start = total("current")
    with tracker:
        step()
    model.zero_grad(set_to_none=True)
    return total("peak") - start
