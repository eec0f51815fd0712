"""DiffSynth-Studio (PyPI ``diffsynth``): pipelines whose ``__call__`` is ``@torch.no_grad()``, its
DeepSpeed block checkpoint, and its copy of Wan-Animate's motion encoder.

Every pipeline class of 2.1.12 (``WanVideoPipeline``, ``QwenImagePipeline``, ``FluxImagePipeline``,
``ZImagePipeline``, ... 27 classes) derives from ``diffsynth.diffusion.base_pipeline.BasePipeline`` and
decorates its own ``__call__``. One patch on ``BasePipeline.__init_subclass__`` (which the base inherits
from ``torch.nn.Module``) covers the hierarchy, classes defined later included; semantics, and what a
body ending in PIL/numpy does with ``cache=False`` (an error saying how to get the tensor), in
:mod:`gradpatch.sampling.families.diffsynth`. ``gradient_checkpoint_forward`` with DeepSpeed activation
checkpointing configured runs the fixed checkpoint instead of DeepSpeed's reentrant one, so blocks
whose inputs do not require grad are checkpointed too and their parameters trained
(:mod:`gradpatch.sampling.families.diffsynth_checkpoint`). ``Generator.get_motion`` (Wan-Animate's motion
encoder, copied from Wan2.2) checkpoints ``enc_motion`` with ``use_reentrant=True`` on face frames that
never require grad: made non-reentrant (:mod:`gradpatch.sampling.families.wan`).
Tested against the installed package in ``tests/upstream/test_diffsynth_pipelines.py``.
"""
from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.patch import Patch

from .diffusers import PipelineHierarchy

_REQUIRES = "diffsynth>=2.0,<2.2"

PATCHES = [
    Patch(
        "diffsynth.pipelines",
        "diffsynth.diffusion.base_pipeline:BasePipeline.__init_subclass__",
        "gradpatch.sampling.families.diffsynth:patch_pipeline_hierarchy",
        PipelineHierarchy("BasePipeline", "BasePipeline hierarchy · @torch.no_grad() __call__"),
        "diffsynth",
        "pipeline __call__ takes cache=False (gradients), grad_steps, checkpoint_steps",
        requires=_REQUIRES,
    ),
    Patch(
        "diffsynth.gradient_checkpoint_forward",
        "diffsynth.core.gradient.gradient_checkpoint:gradient_checkpoint_forward",
        "gradpatch.sampling.families.diffsynth_checkpoint:gradient_checkpoint_forward",
        Fingerprints({"aacc91ded6fee158": "diffsynth 2.1.12",
                      # passes keyword arguments positionally on that path; the fix passes them by name, as its
                      # other paths do
                      "0c4ac0965aedafe7": "modelscope/DiffSynth-Studio@4ec4d9c (2026-03-17) to fed7b18 (2026-08-20)"},
                     over=("gradient_checkpoint_forward", "judge_args_requires_grad",
                           "create_custom_forward_use_reentrant")),
        "diffsynth",
        "DeepSpeed block checkpoint: the fixed checkpoint (frozen-input blocks checkpointed and trained)",
        requires=_REQUIRES,
    ),
    Patch(
        "diffsynth.Generator.get_motion",
        "diffsynth.models.wan_video_animate_adapter:Generator.get_motion",
        "gradpatch.sampling.families.wan:motion_non_reentrant",
        Fingerprints({"12cea4ef5f127399": "diffsynth 2.1.12 = modelscope/DiffSynth-Studio@a36f2f6 (2025-09-30) to "
                                          "fed7b18 (2026-08-20)"}),
        "diffsynth",
        "Wan-Animate motion encoder checkpoint non-reentrant: its parameters get gradients",
        requires=_REQUIRES,
    ),
]
