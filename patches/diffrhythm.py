"""DiffRhythm (GitHub ASLP-lab/DiffRhythm; no installable package carries it): ``CFM.sample``.

DiffRhythm's ``model/cfm.py`` is F5-TTS's ``CFM`` grown for songs: ``CFM.sample`` is
``@torch.no_grad()``, calls ``self.eval()`` and integrates ``self.transformer`` (two calls per
evaluation for classifier-free guidance, with a negative style prompt) through the module global
``odeint`` (torchdiffeq). That is F5's shape, so F5's fix is declared for it unchanged:
``sample(..., cache=False, grad_steps=K, checkpoint_steps=True)`` gives gradients to the DiT, ``cond``
and the style prompts, keeps the caller's train/eval mode, and counts a step per solver step
(``odeint_kwargs`` must name a fixed-grid method for ``grad_steps``: DiffRhythm's default is Euler).
The module is the top-level ``model.cfm`` of a repository checkout (a generic name: the fingerprints
below, from every version of the file in the repository's history, decide). Tested on a replica of
its sampler in ``tests/test_diffrhythm_replica.py``.
"""
from gradpatch.patching.fingerprint import Fingerprints, has_parameter
from gradpatch.patching.registry import Patch

SAMPLE = Fingerprints(
    known={
        "056bf98573e13047": "DiffRhythm git 5909b2a to a6aa722 (2025-03-05 to 2025-03-13)",
        "63227f143616ee6f": "DiffRhythm git c93f59a (2025-03-17)",
        "f87169b02a46cae3": "DiffRhythm git fce85e5 (2025-05-08)",
        "af621de49b303f98": "DiffRhythm git fc54560 (2025-09-02) to 28ad63c (2025-11-27)",
    },
    fixed_if=has_parameter("cache"),
)

PATCHES = [
    Patch("diffrhythm.sample", "model.cfm:CFM.sample", "gradpatch.sampling.runner:differentiable_sampler", SAMPLE,
          "diffrhythm", "CFM.sample(cache=False): gradients through the ODE solve, caller's mode kept; "
                        "grad_steps, checkpoint_steps"),
]
