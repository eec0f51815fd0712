"""Tango / Tango 2 / Mustango (GitHub declare-lab/tango; PyPI ``tango`` is unrelated): opt-in, not declared.

``models.py: AudioDiffusion.inference`` (also ``tango2/models.py`` and ``mustango/models.py``) is
``@torch.no_grad()`` around a hand-written diffusers loop (not a ``DiffusionPipeline``, so the diffusers
fix does not see it): FLAN-T5 prompt embeddings, then ``num_steps`` iterations of ``self.unet`` (CFG
batched) and ``inference_scheduler.step``. Each checkout runs it as a top-level module named ``models``,
a name countless projects use, so it is not declared (a declaration would fire on every ``models.py``);
opt in with one line, before or after the import::

    gradpatch.differentiable("models:AudioDiffusion.inference", step="unet", steps="num_steps")
    model.inference(prompt, scheduler, num_steps=20, cache=False, grad_steps=2)

Gradients then reach the UNet (a step is one ``self.unet`` call; the scheduler's ``step`` stays outside
every recomputed region). The text encoder's in-body ``with torch.no_grad():`` is part of the sampler's
code and inert during the call: a frozen T5 keeps activations it does not need. ``KNOWN`` are the
fingerprints (``python -m gradpatch.patching.fingerprint models.py AudioDiffusion.inference``) of every
version in the repository's history, for checking a checkout; ``FIX`` is what the line above installs,
tested on a replica in ``tests/upstream/test_tango_replica.py``. The vendored AudioLDM copies are covered by
``patches/audioldm.py``.
"""
from gradpatch.sampling.generic.any_sampler import sampler

TARGET = "models:AudioDiffusion.inference"
FIX = sampler(step="unet", steps="num_steps")
KNOWN = {"f1cffd3a519bd4ca": "tango git ceb8bd5 to f8c08ff (2023-04/05); mustango bc247dd (2023-11)",
         "eaededc56ff6527c": "tango git 39e4f90 (2023-07-15) to 34ecd38 (2025-07); tango2 6ec558c"}

PATCHES: list = []
