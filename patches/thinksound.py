"""ThinkSound (PyPI ``thinksound``; GitHub FunAudioLLM/ThinkSound): its samplers cannot be differentiated.

``ThinkSound.inference.sampling`` is stable-audio-tools' early sampling module: ``sample_discrete_euler``
(rectified flow, reached through ``sample_rf`` and ``generate_diffusion_cond``) and ``sample``
(v-diffusion DDIM) are ``@torch.no_grad()``; ``sample_k`` calls ``k_diffusion.sampling``
(``patches/k_diffusion.py``). Without the patch, ``cache=False`` falls through ``**extra_args`` into the
model (``TypeError`` there, or silently ignored by a model that swallows keywords).

The fix is the stable-audio-tools forks' family (``patches/_families.py``, ``SAT_FORKS``: the same code
is found at any other path, AudioX's and SongBloom's included): ``cache=True`` (the original),
``cache=False``, ``grad_steps=K`` (one model evaluation per step, N the ``steps`` argument),
``checkpoint_steps=True``; every other keyword still reaches the model. 0.0.19 imports with
``--no-deps`` on this environment.
"""
from __future__ import annotations

from ._families import SAT_FORK_PAIR, SAT_FORKS

PATCHES = SAT_FORKS.patches("thinksound", "ThinkSound.inference.sampling", SAT_FORKS.known(SAT_FORK_PAIR),
                            over=SAT_FORK_PAIR, requires="thinksound")
