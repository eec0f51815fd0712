"""VoxCPM / VoxCPM2 (PyPI ``voxcpm``; GitHub OpenBMB/VoxCPM): the per-patch flow-matching sampler.

``voxcpm.modules.locdit.unified_cfm.UnifiedCFM.forward`` is ``@torch.inference_mode()`` over an
undecorated Euler loop with CFG-Zero* (fresh CFG buffers each step, one estimator call per step
except the first ``zero_init_steps``, which use a zero velocity). ``forward(..., cache=False)`` and
``checkpoint_steps=True``: gradients to the local DiT and to ``mu``/``cond``. ``grad_steps`` needs one
estimator call per step: pass ``use_cfg_zero_star=False``, or it raises (the steps cannot be told
apart). Not covered: the training ``VoxCPM2Model.forward(sample_generate=True)`` calls the sampler
with upstream's defaults (``feat_pred`` is an inference tensor), and the autoregressive loop
(``_generate``) writes a static KV cache in place. Tested against voxcpm 2.0.3.
"""
from ._families import flow_matching_family

PATCHES = flow_matching_family("voxcpm", "voxcpm.modules.locdit.unified_cfm",
                               ("UnifiedCFM.forward", "UnifiedCFM.solve_euler"), requires="voxcpm")
