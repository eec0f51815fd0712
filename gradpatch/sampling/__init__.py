"""Differentiable samplers: one interface, ``cache=True`` (upstream, bitwise) or ``cache=False``
(gradients flow), with ``grad_steps`` and ``checkpoint_steps``.

By role:

* ``contract``: the one entry every sampler goes through (validation, defaults, misspelt options,
  joining an outer ``cache=False`` call, refusal, "had no effect"); ``options``: the values.
* ``run``: one ``cache=False`` call in progress (:class:`~gradpatch.sampling.run.SamplingRun`), the
  ``eval``/``forward`` shadows that act only in its context (made with ``shadows``), and
  :func:`~gradpatch.sampling.run.run_step`, which applies ``grad_steps``/``checkpoint_steps`` to one
  denoiser evaluation.
* ``steps/``: what ``run_step`` uses: ``checkpoint`` (recompute per evaluation), ``inputs`` (the
  step's inputs as the forward saw them), ``budget`` (``checkpoint_steps="budget:<size>"``), ``peak`` and ``peak_plan``
  (``checkpoint_steps="peak:<size>"``), ``window``
  and ``regions`` (where ``grad_steps`` resumes recording), ``odeint`` (torchdiffeq solver steps).
* ``lifting/``: ``lift`` (a copy of a function without its in-body ``no_grad``), ``bytecode``
  (what a code object is; torch's grad-mode decorator wrapper).
* ``generic/``: :func:`gradpatch.differentiable` for any sampler: ``any_sampler`` (the public
  function, torch-free), ``callables`` (what it returns), ``call`` (one call), ``gradoff`` (the
  sampler's grad-off managers made inert), ``copy_on_write`` (in-place writes), ``coroutine``.
* ``families/``: what each catalogued family adds: ``ode`` (F5/E2), ``functions`` (k-diffusion,
  stable-audio-tools), ``ldm``/``ldm_guards``/``ldm_dpm_solver``/``ldm_uncovered`` (latent-diffusion
  natives), ``diffusers``/``diffusers_run`` (pipelines).
* ``values``: reading tensors out of what a call returns (shared by ``steps`` and ``generic``).
"""
