"""DPM-Solver as the ldm family ships it (``ldm.models.diffusion.dpm_solver``: CompVis SD1, Stability
SD2, ControlNet, PyPI stable-diffusion-sdkit; ``audioldm_train.modules.latent_diffusion.dpm_solver``).

``DPMSolverSampler.sample`` is an ordinary ``@torch.no_grad()`` entry point (declared with
:func:`gradpatch.sampling.families.ldm.entry`). Its body wraps ``self.model.apply_model`` in a model
function (``model_wrapper``: classifier-free guidance as one batched call) and hands it to
``DPM_Solver(model_fn, ...).sample``, whose body runs every solver method inside
``with torch.no_grad():`` blocks, so unwrapping the entry point alone still gives no graph.

:func:`solver_sample` is the fix for ``DPM_Solver.sample``. Outside a ``cache=False`` call of the family
(see :mod:`gradpatch.sampling.families.ldm`) it is the original. Inside one it runs the copy with those
blocks lifted (:func:`gradpatch.sampling.lifting.lift.lift_no_grad`), and a step is one call of the solver's model
function (``DPM_Solver.model``, the function it was constructed with): while such a call runs, the
family's per-step machinery knows how many calls are left after it, so ``grad_steps=K`` builds the
graph for the last K calls only and ``checkpoint_steps=True`` recomputes each ``apply_model``
evaluation in backward. Only the network evaluation is recomputed: the solver's history of model
outputs (``model_prev_list`` of the multistep method), its time steps and the noise schedule stay
outside the recomputed region.

The number of calls is known in advance for ``method="multistep"`` and ``"singlestep"`` (upstream
documents ``steps`` function evaluations for both, plus one for ``denoise_to_zero``); ``grad_steps``
with ``"adaptive"`` (what ``DPMSolverSampler`` uses for ``S=1``) or ``"singlestep_fixed"`` raises
ValueError, and a solve that made a different number of calls than counted raises RuntimeError
rather than return a graph truncated at the wrong step.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from gradpatch.sampling.families.ldm import active_run, at_step
from gradpatch.sampling.lifting.lift import lift_no_grad

COUNTED_METHODS = ("multistep", "singlestep")
"""``DPM_Solver.sample`` methods whose number of model-function calls is ``steps`` (+1 with
``denoise_to_zero``)."""


def solver_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    """Fix factory for ``DPM_Solver.sample(self, x, steps=20, ..., method=..., denoise_to_zero=...)``
    (module docstring). A new object per call."""
    lifted = lift_no_grad(original)
    signature = inspect.signature(lifted)

    @functools.wraps(original)
    def sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        run = active_run()
        if run is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        method, steps = bound.arguments["method"], bound.arguments["steps"]
        total = None
        if run.options.grad_steps is not None:
            if method not in COUNTED_METHODS:
                raise ValueError(f"grad_steps needs DPM-Solver's method to be one of {COUNTED_METHODS}, whose "
                                 f"model-function calls are counted in advance; this call uses {method!r} "
                                 "(DPMSolverSampler picks 'adaptive' for S=1). Use checkpoint_steps instead.")
            total = int(steps) + bool(bound.arguments["denoise_to_zero"])
        model, calls = self.model, [0]

        def counted(x: Any, t: Any) -> Any:
            calls[0] += 1
            left = 0 if total is None else total - calls[0]
            with at_step(lambda: left):
                return model(x, t)

        # An instance attribute of this solver only: DPMSolverSampler builds one per sampling call.
        self.model = counted
        try:
            out = lifted(self, *args, **kwargs)
        finally:
            self.model = model
        if total is not None and calls[0] != total:
            raise RuntimeError(f"DPM_Solver.sample({method!r}, steps={steps}) called its model function "
                               f"{calls[0]} times, not the {total} that grad_steps was counted against")
        return out

    return sample
