"""Differentiable samplers: one interface, ``cache=True`` (upstream, bitwise) or ``cache=False``
(gradients flow), with ``grad_steps`` and ``checkpoint_steps``.

``options`` (the options and their validation), ``runner`` (the generic differentiable run and its
steps), ``lift`` (compiling a copy of a function without its in-body ``no_grad``), and the
specifics: ``function_sampler`` (F5/E2, k-diffusion, stable-audio-tools: samplers that are
functions or methods), ``ldm``/``ldm_guards``/``ldm_dpm_solver`` (the latent-diffusion family's native
samplers), ``diffusers``/``diffusers_run`` (pipelines).
"""
