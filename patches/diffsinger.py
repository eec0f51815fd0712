"""DiffSinger (GitHub openvpi/DiffSinger; PyPI carries wrappers only): the rectified-flow sampler.

``modules/core/reflow.py: RectifiedFlow.inference`` and the step methods ``sample_euler``/``rk2``/
``rk4``/``rk5`` are ``@torch.no_grad()``, and each step updates the state in place after the network
read it (``x += self.velocity_fn(x, t, cond) * dt``): unwrapped, backward fails ("modified by an
inplace operation"). ``forward(condition, cache=False, checkpoint_steps=True)`` (the entry training
code calls with ``infer=True``) and ``inference(...)`` run through :func:`gradpatch.differentiable`:
every decorator reached is inert and the in-place updates are copied on write, so the gradients are
those of the out-of-place loop (tested on a replica in ``tests/test_diffsinger_replica.py``). A step
for ``checkpoint_steps`` is one ``velocity_fn`` call (RK4: four per solver step). ``grad_steps`` is not
offered: the number of steps is the global ``hparams['sampling_steps']``, not an argument (it raises
with that reason). The module is a checkout's top-level ``modules.core.reflow``: recognised by
fingerprint (one for every version of the file, 2024-04 to 2026-06).
"""
from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.registry import Patch
from gradpatch.sampling.any_sampler import sampler

_OVER = tuple(f"RectifiedFlow.{m}" for m in ("forward", "inference", "sample_euler", "sample_rk2", "sample_rk4",
                                             "sample_rk5"))
_KNOWN = Fingerprints({"10bb59618193835a": "DiffSinger git 76afe57 (2024-04-17) to 753b7cc (2026-06)"}, over=_OVER)

PATCHES = [
    Patch(f"diffsinger.RectifiedFlow.{entry}", f"modules.core.reflow:RectifiedFlow.{entry}", sampler(step="velocity_fn"),
          _KNOWN, "diffsinger", f"RectifiedFlow.{entry}(cache=False): gradients through the in-place reflow steps; "
                                "checkpoint_steps")
    for entry in ("forward", "inference")
]
