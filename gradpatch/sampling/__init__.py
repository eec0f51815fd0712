"""Differentiable samplers: one interface, ``cache=True`` (upstream, bitwise) or ``cache=False``
(gradients flow), with ``grad_steps`` and ``checkpoint_steps``.

``options`` (the options and their validation), ``runner`` (the generic differentiable run and its
steps; ``_step_checkpoint`` and ``_step_budget`` for ``checkpoint_steps``), ``lift`` (compiling a copy of
a function without its in-body ``no_grad``), and the specifics: ``ode_sampler`` (F5/E2: ``sample``
integrating with torchdiffeq's ``odeint``), ``function_sampler`` (k-diffusion, stable-audio-tools:
samplers that are functions), ``ldm``/``ldm_guards``/``ldm_dpm_solver``/``_ldm_uncovered`` (the latent-diffusion family's native
samplers), ``diffusers``/``diffusers_run`` (pipelines). ``any_sampler`` is ``gradpatch.differentiable``
(torch-free; any sampler, on request or declared in the catalogue), run by ``generic`` with
``_gradoff`` (the sampler's grad-off managers made inert), ``_inplace`` (copy on write) and
``_window`` (where ``grad_steps`` resumes recording); ``_bytecode`` compares code for ``lift``.
"""
