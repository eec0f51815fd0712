"""Tango / Tango 2 / Mustango (GitHub declare-lab/tango; PyPI ``tango`` is unrelated): the sampler.

``models.py: AudioDiffusion.inference`` (also ``tango2/models.py`` and ``mustango/models.py``, each run
as a top-level ``models`` module) is ``@torch.no_grad()`` around a hand-written diffusers loop (not a
``DiffusionPipeline``, so the diffusers fix does not see it): FLAN-T5 prompt embeddings, then
``num_steps`` iterations of ``self.unet`` (CFG batched) and ``inference_scheduler.step``.
``inference(prompt, scheduler, num_steps, cache=False, grad_steps=K, checkpoint_steps=True)`` runs
through :func:`gradpatch.differentiable`: gradients reach the UNet (a step is one ``self.unet`` call;
the scheduler's ``step`` stays outside every recomputed region). The text encoder's in-body
``with torch.no_grad():`` is part of the sampler's code and inert during the call: a frozen T5 then
keeps activations it does not need (``requires_grad_(False)`` on it gives no gradient either way).
The vendored AudioLDM copies are covered by ``patches/audioldm.py``. ``models`` is a generic name:
recognised by fingerprint (both versions of ``inference`` in the repository's history); tested on a
replica in ``tests/test_tango_replica.py``.
"""
from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.registry import Patch
from gradpatch.sampling.any_sampler import sampler

PATCHES = [
    Patch("tango.AudioDiffusion.inference", "models:AudioDiffusion.inference", sampler(step="unet", steps="num_steps"),
          Fingerprints({"f1cffd3a519bd4ca": "tango git ceb8bd5 to f8c08ff (2023-04/05); mustango bc247dd (2023-11)",
                        "eaededc56ff6527c": "tango git 39e4f90 (2023-07-15) to 34ecd38 (2025-07); tango2 6ec558c"}),
          "tango", "AudioDiffusion.inference(cache=False): gradients to the UNet; grad_steps, checkpoint_steps"),
]
