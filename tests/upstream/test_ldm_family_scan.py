"""The latent-diffusion family's samplers found at paths no patch names (fresh interpreters).

``myfork/ddim.py`` is a byte-identical copy of the installed stable-diffusion-sdkit file
``ldm/models/diffusion/ddim.py`` (SD2's ``DDIMSampler``; it imports ``ldm.modules.diffusionmodules.util``),
as research repositories vendor it. Under ``gradpatch.apply()`` its methods are recognised one by one
from the versions declared once in ``patches/_ldm_samplers.py`` and get the declared path's fixes: its
``cache=False`` gradients equal those of the declared ``ldm.models.diffusion.ddim.DDIMSampler`` on the
same tiny model, and its ``cache=True`` is upstream's (no graph). A copy with one method edited has that
method left alone with a warning while its siblings are patched; a class that only shares the name is
not touched.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from support import last_json, run_python

pytestmark = pytest.mark.slow

RUN = '''
import json, warnings
import torch
import gradpatch
from gradpatch.testing_ldm import LATENT, sdkit_model

warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    gradpatch.apply()
    import myfork.ddim
    import ldm.models.diffusion.ddim as declared

def grads(sampler_class, cache):
    torch.manual_seed(0)
    model, cond, uncond = sdkit_model(seed=0)
    z, _ = sampler_class(model).sample(S=4, batch_size=2, shape=LATENT, conditioning=cond, verbose=False,
                                       unconditional_guidance_scale=3.0, unconditional_conditioning=uncond,
                                       cache=cache)
    if not z.requires_grad:
        return None
    z.square().mean().backward()
    return {n: p.grad for n, p in model.model.named_parameters() if p.grad is not None}

copy, reference = grads(myfork.ddim.DDIMSampler, False), grads(declared.DDIMSampler, False)
records = {r.patch: (str(r.status), r.reason) for r in gradpatch.report() if r.patch.startswith("myfork.")}
print(json.dumps({
    "records": records,
    "upstream_graph": grads(myfork.ddim.DDIMSampler, True) is not None,
    "tensors": len(copy), "reference_tensors": len(reference),
    "max_diff": max(float((copy[n] - reference[n]).abs().max()) for n in reference),
    "warnings": [str(w.message) for w in caught if "myfork" in str(w.message)],
}))
'''


@pytest.fixture()
def fork(tmp_path: Path) -> Path:
    source = Path(importlib.util.find_spec("ldm.models.diffusion.ddim").origin).read_text()
    package = tmp_path / "myfork"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "ddim.py").write_text(source)
    return package


def test_a_vendored_sampler_is_found_and_gives_the_declared_paths_gradients(fork: Path) -> None:
    result = last_json(run_python(RUN, pythonpath=[fork.parent]))
    records = result["records"]
    sample = records["myfork.ddim.DDIMSampler.sample"]
    assert sample[0] == "applied" and "copy found by scan (ldm_sampling)" in sample[1]
    assert records["myfork.ddim.DDIMSampler.p_sample_ddim"][0] == "applied"
    assert records["myfork.ddim.DDIMSampler.register_buffer"][0] == "skipped"  # sdkit's is fixed upstream
    assert not result["upstream_graph"]
    assert result["tensors"] == result["reference_tensors"] > 0
    assert result["max_diff"] == 0.0
    assert result["warnings"] == []


def test_an_edited_method_is_left_alone_and_unrelated_classes_are_not_copies(fork: Path) -> None:
    ddim = fork / "ddim.py"
    source = ddim.read_text()
    edited = source.replace("def p_sample_ddim(self, x, c, t, index,", "def p_sample_ddim(self, x, c, t, index, _unused=None,")
    assert edited != source
    ddim.write_text(edited)
    (fork / "unrelated.py").write_text("class DDIMSampler:\n    def sample(self, steps):\n        return steps\n")
    code = RUN.replace("    import myfork.ddim\n", "    import myfork.ddim, myfork.unrelated\n")
    code = code[:code.index("copy, reference =")] + '''records = {r.patch: (str(r.status), r.reason) for r in gradpatch.report()}
print(json.dumps({"records": records, "unrelated": [p for p in records if "unrelated" in p],
                  "warnings": [str(w.message) for w in caught if "myfork" in str(w.message)]}))
'''
    result = last_json(run_python(code, pythonpath=[fork.parent]))
    records = result["records"]
    assert records["myfork.ddim.DDIMSampler.p_sample_ddim"][0] == "skipped"
    assert "unknown code" in records["myfork.ddim.DDIMSampler.p_sample_ddim"][1]
    assert records["myfork.ddim.DDIMSampler.sample"][0] == "applied"
    assert result["unrelated"] == []
    assert len(result["warnings"]) == 1 and "p_sample_ddim" in result["warnings"][0]
