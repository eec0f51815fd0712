"""The sampling modules' old paths stay importable for one release, each with a DeprecationWarning, as
the new module itself (so monkeypatching either name patches both), and the fix strings plug-ins wrote
against them still resolve. Fresh interpreters: a module imported once does not warn again."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

MOVED = {
    "runner": "run", "ode_sampler": "families.ode", "function_sampler": "families.functions",
    "ldm": "families.ldm", "ldm_guards": "families.ldm_guards", "ldm_dpm_solver": "families.ldm_dpm_solver",
    "diffusers": "families.diffusers", "diffusers_run": "families.diffusers_run",
    "any_sampler": "generic.any_sampler", "lift": "lifting.lift",
}

OLD_FIX_STRINGS = [
    "gradpatch.sampling.ode_sampler:differentiable_sampler",
    "gradpatch.sampling.function_sampler:fixed_step_sampler",
    "gradpatch.sampling.ldm:entry",
    "gradpatch.sampling.ldm_guards:buffers_follow_model",
    "gradpatch.sampling.diffusers:patch_pipeline_hierarchy",
    "gradpatch.sampling.generic:patched",
]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_warns_and_is_the_new_module(old):
    new = MOVED[old]
    result = _python(f"""
import importlib, json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    module = importlib.import_module("gradpatch.sampling.{old}")
print(json.dumps([module is importlib.import_module("gradpatch.sampling.{new}"),
                  [str(w.message) for w in caught if w.category is DeprecationWarning]]))
""")
    assert result.returncode == 0, result.stderr
    same, messages = json.loads(result.stdout.strip().splitlines()[-1])
    assert same
    assert any(f"gradpatch.sampling.{old}" in m and f"gradpatch.sampling.{new}" in m for m in messages), messages


def test_old_fix_strings_resolve():
    result = _python(f"""
import warnings
warnings.simplefilter("ignore")
from gradpatch.patching.hooks import resolve
for dotted in {OLD_FIX_STRINGS!r}:
    assert callable(resolve(dotted)), dotted
print("ok")
""")
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr


def test_importing_gradpatch_stays_torch_free():
    result = _python("import sys, gradpatch, gradpatch.sampling.generic.any_sampler, gradpatch.sampling.contract\n"
                     "print('torch' in sys.modules)")
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr
