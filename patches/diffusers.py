"""diffusers (PyPI ``diffusers``): pipelines whose ``__call__`` is ``@torch.no_grad()``.

291 of 295 pipeline classes in 0.42.1 decorate their own ``__call__`` with ``@torch.no_grad()``, so
no output of ``pipe(...)`` ever has a gradient; AlignProp and trl copied ``__call__`` bodies by hand to
get one. One patch covers the whole ``DiffusionPipeline`` class hierarchy, including pipeline classes
defined after it is applied; see :mod:`gradpatch.sampling.families.diffusers` for the semantics.
Modular pipelines (``diffusers.modular_pipelines``) take two more: ``ModularPipeline.__call__`` and
the ``ModularPipelineBlocks`` hierarchy (:mod:`gradpatch.sampling.families.diffusers_modular`).

The patch targets ``DiffusionPipeline.__init_subclass__``, which the base class inherits from
``object``: the fix patches every pipeline class defined so far and installs an ``__init_subclass__``
that patches each one defined later; revert removes it and restores every class it touched.
"""
from __future__ import annotations

from types import FunctionType, ModuleType
from typing import NamedTuple

from gradpatch.patching.fingerprint import Identity, has_parameter
from gradpatch.patching.patch import Patch

_REQUIRES = "diffusers>=0.25,<0.43"


class PipelineHierarchy(NamedTuple):
    """Recognise ``module.<base>`` as a class hierarchy the fix can take over: a class that does not
    define ``__init_subclass__`` itself (the fix installs one). Which subclasses have a
    ``@torch.no_grad()`` ``__call__`` is decided per class by the fix, also for classes created later."""

    base: str
    label: str

    def identify(self, module: ModuleType, qualname: str, original: object) -> Identity:
        base = getattr(module, self.base, None)
        if not isinstance(base, type):
            return Identity("unknown", f"no class {self.base}")
        if "__init_subclass__" in vars(base):
            return Identity("unknown", f"{self.base} defines __init_subclass__")
        return Identity("known", self.label)


class LacksParameter(NamedTuple):
    """Recognise a plain function that does not take ``name`` yet (if it does, upstream fixed it)."""

    name: str
    label: str

    def identify(self, module: ModuleType, qualname: str, original: object) -> Identity:
        if not isinstance(original, FunctionType):
            return Identity("unknown", f"{qualname} is not a plain function")
        if has_parameter(self.name)(original):
            return Identity("fixed", f"{qualname} already takes {self.name!r}")
        return Identity("known", self.label)


PATCHES = [
    Patch(
        "diffusers.pipelines",
        "diffusers.pipelines.pipeline_utils:DiffusionPipeline.__init_subclass__",
        "gradpatch.sampling.families.diffusers:patch_pipeline_hierarchy",
        PipelineHierarchy("DiffusionPipeline", "DiffusionPipeline hierarchy · @torch.no_grad() __call__"),
        "diffusers",
        "pipeline __call__ takes cache=False (gradients), grad_steps, checkpoint_steps",
        requires=_REQUIRES,
    ),
    # Modular pipelines are not DiffusionPipelines: the pipeline's __call__ runs its blocks under an
    # in-body no_grad (lifted), and every block's own __call__ is @torch.no_grad() (a second hierarchy).
    Patch(
        "diffusers.modular_pipelines",
        "diffusers.modular_pipelines.modular_pipeline:ModularPipeline.__call__",
        "gradpatch.sampling.families.diffusers_modular:modular_call",
        LacksParameter("cache", "ModularPipeline.__call__ · in-body torch.no_grad()"),
        "diffusers",
        "modular pipeline __call__ takes cache=False (gradients), grad_steps, checkpoint_steps",
        requires=_REQUIRES,
    ),
    Patch(
        "diffusers.modular_pipelines.blocks",
        "diffusers.modular_pipelines.modular_pipeline:ModularPipelineBlocks.__init_subclass__",
        "gradpatch.sampling.families.diffusers_modular:patch_block_hierarchy",
        PipelineHierarchy("ModularPipelineBlocks", "ModularPipelineBlocks hierarchy · @torch.no_grad() __call__"),
        "diffusers",
        "block __call__ runs undecorated inside a modular pipeline's cache=False call",
        requires=_REQUIRES,
    ),
]
