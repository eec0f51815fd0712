"""Matcha-TTS (PyPI ``matcha-tts``; GitHub shivammehta25/Matcha-TTS): the flow-matching decoder.

``matcha.models.components.flow_matching.BASECFM.forward`` is ``@torch.inference_mode()`` over an
undecorated Euler loop (``solve_euler``, one ``self.estimator`` call per step, no CFG). It is the
ancestor of the flow-matching family (``patches/_families.py``), so the same declaration finds its
copies at any path (Chatterbox vendors it unchanged). ``forward(..., cache=False, grad_steps=K,
checkpoint_steps=True)``: gradients through the solve to the estimator and to ``mu``, ``spks`` and
``cond``; a step is one estimator call. Tested against matcha-tts 0.0.7.2 (installed with
``--no-build-isolation``: its Cython extension must be built against the installed numpy).

Not declared: ``MatchaTTS.synthesise`` (``@torch.inference_mode()``, text to mel). Call the decoder
(``model.decoder(mu_y, y_mask, n_timesteps, cache=False)``) or ``gradpatch.differentiable(
model.synthesise, step=model.decoder.estimator, steps="n_timesteps")``.
"""
from ._families import flow_matching_family

PATCHES = flow_matching_family("matcha", "matcha.models.components.flow_matching",
                               ("BASECFM.forward", "BASECFM.solve_euler"), requires="matcha-tts")
