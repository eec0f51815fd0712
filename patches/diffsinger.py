"""DiffSinger (GitHub openvpi/DiffSinger; PyPI carries wrappers only): the rectified-flow sampler, opt-in.

``modules/core/reflow.py: RectifiedFlow.inference`` and the step methods ``sample_euler``/``rk2``/
``rk4``/``rk5`` are ``@torch.no_grad()``, and each step updates the state in place after the network
read it (``x += self.velocity_fn(x, t, cond) * dt``): unwrapped, backward fails ("modified by an
inplace operation"). A checkout imports it as the top-level ``modules.core.reflow``, a path other
projects use too, so it is not declared; opt in with one line::

    gradpatch.differentiable("modules.core.reflow:RectifiedFlow.forward", step="velocity_fn")
    mel = model(condition, cache=False, checkpoint_steps=True)

Every decorator the call reaches is then inert and the in-place updates are copied on write, so the
gradients are those of the out-of-place loop (tested on a replica in ``tests/upstream/test_diffsinger_replica.py``
with ``FIX``, Euler and RK4). A step for ``checkpoint_steps`` is one ``velocity_fn`` call (RK4: four per
solver step). ``grad_steps`` is not offered: the number of steps is the global
``hparams['sampling_steps']``, not an argument (it raises with that reason). ``KNOWN``: the fingerprint
of ``RectifiedFlow.forward``, ``inference`` and the four step methods hashed together, the same for
every version of the file (2024-04 to 2026-06).
"""
from gradpatch.sampling.generic.any_sampler import sampler

TARGETS = ("modules.core.reflow:RectifiedFlow.forward", "modules.core.reflow:RectifiedFlow.inference")
FIX = sampler(step="velocity_fn")
KNOWN = {"10bb59618193835a": "DiffSinger git 76afe57 (2024-04-17) to 753b7cc (2026-06)"}

PATCHES: list = []
