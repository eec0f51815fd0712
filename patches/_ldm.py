"""Declaring the latent-diffusion family's sampling fixes (no logic, no torch).

Every known version of every method is declared once, with its role, in :mod:`._ldm_samplers` and
:mod:`._ldm_models`; the roles (:mod:`._ldm_roles`) name the fix factories of
:mod:`gradpatch.sampling.families.ldm`, :mod:`gradpatch.sampling.families.ldm_guards` and
:mod:`gradpatch.sampling.families.ldm_dpm_solver`, documented there. A codebase declares only where its classes
live and which of the family's methods each defines::

    ldm_sampling("audioldm2", {
        "audioldm2.latent_diffusion.models.ddim:DDIMSampler": "sample encode decode ddim_sampling ...",
        "audioldm2.latent_diffusion.models.ddpm:LatentDiffusion": "sample decode_first_stage:lifted ...",
    }, requires="audioldm2<1")

Each method becomes one :class:`~gradpatch.patching.patch.Patch` named ``"<upstream>.<Class>.<method>"``,
recognised by every known version of that method (wherever it was found first), so an edited method is
left alone (with a warning) while its siblings are patched. The same table is the family
:data:`LDM_SAMPLING` the scan looks for at every other path: a class of the family's name with a
known method gets the same patches, named after its module. ``:lifted`` selects the versions whose body
holds an in-body ``no_grad`` (recognised with :class:`gradpatch.sampling.lifting.lift.Liftable`: the fingerprint
of the source the loaded code object points at).
"""
from __future__ import annotations

from typing import Any, Mapping

from gradpatch.patching.families import MethodVersions
from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.patch import Patch
from gradpatch.sampling.lifting.lift import Liftable

from ._ldm_models import MODELS
from ._ldm_roles import FIXES, LIFTED, SOLVER, SUMMARIES
from ._ldm_samplers import SAMPLERS

VERSIONS: dict[str, tuple[Any, ...]] = {**SAMPLERS, **MODELS}  # key -> (role, known[, fixed])


def ldm_sampling(upstream: str, classes: Mapping[str, str], *, requires: str | None = None,
                 name: str | None = None) -> list[Patch]:
    """One :class:`Patch` per method that ``classes`` (``"module:Class"`` -> ``"method method:lifted ..."``)
    names, called ``"<name or upstream>.<Class>.<method>"``; see the module docstring."""
    patches = []
    for where, methods in classes.items():
        module, _, cls = where.partition(":")
        for method in methods.split():
            method_name, _, variant = method.partition(":")
            key = f"{cls}.{method_name}" + (f":{variant}" if variant else "")
            if key not in VERSIONS:
                raise ValueError(f"{upstream}: no known versions of {key!r}; declare them in "
                                 "patches/_ldm_samplers.py or patches/_ldm_models.py")
            role, known, *fixed = VERSIONS[key]
            liftable = role in (LIFTED, SOLVER)
            recognise = (Liftable if liftable else Fingerprints)(dict(known), dict(fixed[0]) if fixed else {})
            qualname = f"{cls}.{method_name}"
            patches.append(Patch(f"{name or upstream}.{qualname}", f"{module}:{qualname}", f"{FIXES[role]}:{role}",
                                 recognise, upstream, SUMMARIES[role], requires))
    return patches


#: The family, found by the scan wherever a codebase copied its classes (``ldm_sampling`` declares the
#: known paths with their provenance and version ranges).
LDM_SAMPLING = MethodVersions("ldm_sampling", VERSIONS, ldm_sampling,
                              frozenset(f"{FIXES[role]}:{role}" for role, *_ in VERSIONS.values()))
