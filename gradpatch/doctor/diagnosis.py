"""The doctor's conclusions after a backward: :func:`explain_grads` names, for each parameter meant to
train that got no gradient, the module involved and the likely cause; :func:`grad_doctor` wraps one
step and prints them (as :mod:`~gradpatch.doctor.findings` words them). What the doctor looks for is
in :mod:`gradpatch.doctor`'s docstring."""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Iterator

import torch
import torch.utils.checkpoint

from gradpatch.doctor.findings import HEALTHY, WIDTH, Diagnosis, Finding, healthy_line
from gradpatch.doctor.watch import Watch, watching
from gradpatch.patching import activation
from gradpatch.patching.ledger import LEDGER
from gradpatch.patching.fingerprint import Fingerprints

_REMEDY = "run with GRADPATCH=1 (or call gradpatch.apply() before the training step)"
__all__ = ["HEALTHY", "WIDTH", "Diagnosis", "Finding", "checkpoint_plan_text", "explain_grads", "grad_doctor",
           "healthy_line"]


def _remedy(module_name: str) -> str:
    """What to do about a broken checkpoint that ``module_name`` calls."""
    patch = next((p for p in activation.known_patches().values()
                  if p.module == module_name and p.qualname == "checkpoint"), None)
    if patch is None:
        return (f"{module_name} is not code gradpatch patches: pass use_reentrant=False to "
                "torch.utils.checkpoint.checkpoint there, or bind "
                "gradpatch.checkpointing.checkpoint.non_reentrant(torch.utils.checkpoint.checkpoint) in its place")
    record = next((r for r in activation.report() if r.patch == patch.name), None)
    if record is not None and LEDGER.is_wanted(patch.name):
        return (f"gradpatch's {patch.name!r} is active here but not in effect ({record.status.value}: "
                f"{record.reason}); see gradpatch.report()")
    return _REMEDY


def _broken_checkpoint(module_class: type, watched: bool = False) -> tuple[str, str] | None:
    """Why the ``checkpoint`` this class's module calls is broken, if it is, and what to do. Torch's
    checkpoint is recognised here, from the code (any name bound to it, or ``torch.utils.checkpoint``
    reached by attributes), only when no :class:`Watch` saw the calls (``watched``)."""
    forward = getattr(module_class, "forward", None)
    names = getattr(getattr(forward, "__code__", None), "co_names", ())
    if "checkpoint" not in names and watched:
        return None
    namespace = getattr(sys.modules.get(module_class.__module__), "__dict__", {})
    if not watched:
        for name in names:
            value = namespace.get(name)
            if value is torch.utils.checkpoint.checkpoint or (
                    value in (torch, torch.utils, torch.utils.checkpoint) and "checkpoint" in names):
                return (f"{module_class.__name__} calls torch.utils.checkpoint.checkpoint; reentrant (its "
                        "default, or use_reentrant=True), it gives parameters no gradient when no input "
                        "requires grad", _remedy(module_class.__module__))
    if "checkpoint" not in names:
        return None  # only blocks whose forward itself calls `checkpoint` are checkpointed
    bound = namespace.get("checkpoint")
    if bound is None or bound is torch.utils.checkpoint.checkpoint:
        return None
    for patch in activation.known_patches().values():
        if patch.qualname != "checkpoint" or getattr(bound, "__module__", None) != patch.module:
            continue
        target = sys.modules.get(patch.module)
        if target is None or not isinstance(patch.recognise, Fingerprints):
            continue
        if patch.recognise.identify(target, "checkpoint", bound).verdict == "known":
            return (f"{module_class.__name__} is checkpointed by {patch.module}.checkpoint, the unpatched "
                    "OpenAI/CompVis CheckpointFunction, which cannot differentiate with respect to frozen "
                    "parameters, replays no dropout RNG and drops second-order terms", _remedy(patch.module))
    return None


def _no_grad_sampler(model: torch.nn.Module) -> str | None:
    for patch in activation.known_patches().values():
        owner, _, method = patch.qualname.rpartition(".")
        if method != "sample" or type(model).__name__ != owner or LEDGER.is_installed(patch.name):
            continue
        sample = getattr(type(model), "sample", None)
        if sample is not None and inspect.unwrap(sample) is not sample:
            return (f"{type(model).__name__}.sample is decorated with @torch.no_grad(): nothing computed "
                    "from its output can reach the model's parameters")
    return None


def _modules_in_traceback(error: BaseException) -> list[torch.nn.Module]:
    """Modules whose checkpoint backward raised: upstream's ``CheckpointFunction.backward`` keeps the
    block's bound ``_forward`` as ``ctx.run_function``, so the failing block can be named exactly."""
    found: list[torch.nn.Module] = []
    tb = error.__traceback__
    while tb is not None:
        ctx = tb.tb_frame.f_locals.get("ctx") if tb.tb_frame.f_code.co_name == "backward" else None
        owner = getattr(getattr(ctx, "run_function", None), "__self__", None)
        if isinstance(owner, torch.nn.Module) and owner not in found:
            found.append(owner)
        tb = tb.tb_next
    return found


def _missing(parameter: torch.Tensor) -> bool:
    return parameter.requires_grad and parameter.grad is None


_NO_GRAPH = "does not require grad and does not have a grad_fn"


def _sampler_findings(model: torch.nn.Module, watch: Watch | None, names: tuple[str, ...]) -> list[Finding]:
    """A patched sampler run with ``cache=True`` during the step, on ``model`` or one of its modules
    (or on a module holding ``model``): the likely reason nothing reached ``names``."""
    if watch is None:
        return []
    mine = set(model.modules())
    findings, seen = [], set()
    for name, owner in watch.cached_owners():
        related = owner is None or owner in mine or (isinstance(owner, torch.nn.Module)
                                                     and model in set(owner.modules()))
        if not related or name in seen:
            continue
        seen.add(name)
        findings.append(Finding(name, names, f"{name} ran with cache=True (its default) while grad was on: "
                                "that runs the original @torch.no_grad() sampler, so its output carries no "
                                "gradient", "call it with cache=False (grad_steps=K or checkpoint_steps=True "
                                "bound the memory)"))
    return findings


def _reentrant_findings(model: torch.nn.Module, watch: Watch | None, missing, explained: set[str]) -> list[Finding]:
    """Blocks of ``model`` that torch's reentrant checkpoint ran, with their parameters left without
    a gradient."""
    if watch is None:
        return []
    findings = []
    paths = {m: p for p, m in model.named_modules()}
    for module, call in watch.reentrant_modules().items():
        if module not in paths:
            continue
        path = paths[module]
        names = tuple(n for n in (f"{path}.{k}".lstrip(".") for k, p in module.named_parameters() if missing(p))
                      if n not in explained)
        if not names:
            continue
        explained.update(names)
        caller = call.caller() if call.caller is not None else None
        if caller is not None and caller in paths and not any(module.children()) and module in set(caller.modules()):
            module, path = caller, paths[caller]  # a single layer checkpointed: name its block
        cause = (f"{type(module).__name__} runs torch's reentrant checkpoint (use_reentrant=True or "
                 f"unspecified), called at {call.where}; "
                 + ("no input of that call required grad, so the parameters inside get no gradient"
                    if not call.inputs_require_grad else "it does not support autograd.grad or backward(inputs=)"))
        remedy = ("pass use_reentrant=False there (transformers/diffusers: gradient_checkpointing_enable("
                  "gradient_checkpointing_kwargs={'use_reentrant': False})), or bind "
                  "gradpatch.checkpointing.checkpoint.non_reentrant(torch.utils.checkpoint.checkpoint) in its place")
        findings.append(Finding(f"{path or '<root>'} ({type(module).__name__})", names, cause, remedy))
    return findings


def explain_grads(model: torch.nn.Module, error: BaseException | None = None,
                  watch: Watch | None = None) -> Diagnosis:
    """Diagnose ``model`` after a backward, or after the ``error`` a backward raised.

    With an error raised inside a known-broken checkpoint, the block that raised and its frozen
    parameters are named; with "does not require grad and does not have a grad_fn" after a patched
    sampler ran with ``cache=True``, that sampler. Without an error, every parameter that requires grad
    but was not reached by the backward is reported, grouped by the outermost block whose broken
    checkpoint explains it, the rest as not reached by the loss (or lost in a no-grad sampler).
    Reached means that the backward wrote a gradient, whatever its values: a gradient exactly zero
    because a zero-initialised partner (LoRA's ``lora_B``) multiplies it is healthy. ``watch`` (from
    :func:`grad_doctor` and ``gradpatch doctor``) tells which ``.grad`` the backward wrote and which
    reentrant checkpoints and ``cache=True`` sampler calls ran; without it only ``grad is None`` counts
    as not reached and checkpoints are recognised from the blocks' code.
    """
    diagnosis = Diagnosis(trainable=sum(p.requires_grad for p in model.parameters()))
    paths = {module: path for path, module in model.named_modules()}
    missing = watch.missing if watch is not None else _missing
    if error is not None:
        for block in _modules_in_traceback(error):
            if block in paths:
                frozen = tuple(f"{paths[block]}.{n}".lstrip(".") for n, p in block.named_parameters() if not p.requires_grad)
                cause, remedy = _broken_checkpoint(type(block)) or ("its upstream CheckpointFunction raised in "
                                                                    "backward", _REMEDY)
                diagnosis.findings.append(Finding(f"{paths[block]} ({type(block).__name__})", frozen, cause, remedy,
                                                  frozen=True))
        if not diagnosis.findings and _NO_GRAPH in str(error):
            diagnosis.findings += _sampler_findings(model, watch, ())
            diagnosis.findings += _reentrant_findings(model, watch, lambda p: p.requires_grad, set())
            sampler = _no_grad_sampler(model)
            if sampler:
                diagnosis.findings.append(Finding(type(model).__name__, (), sampler, _REMEDY + ", and call it with "
                                                  "cache=False"))
        return diagnosis
    explained: set[str] = set()
    diagnosis.findings += _reentrant_findings(model, watch, missing, explained)
    for path, module in model.named_modules():
        broken = _broken_checkpoint(type(module), watch is not None)
        if broken is None:
            continue
        cause, remedy = broken
        names = tuple(f"{path}.{n}".lstrip(".") for n, p in module.named_parameters() if missing(p))
        names = tuple(n for n in names if n not in explained)
        if names:
            explained.update(names)
            diagnosis.findings.append(Finding(f"{path} ({type(module).__name__})", names, cause, remedy))
    unreached = tuple(n for n, p in model.named_parameters() if missing(p) and n not in explained)
    if unreached:
        samplers = _sampler_findings(model, watch, unreached)
        if samplers:
            diagnosis.findings += samplers
            return diagnosis
        sampler = _no_grad_sampler(model)
        cause = sampler or ("the loss does not depend on them (a detach(), a no_grad region, an unused "
                            "branch)")
        remedy = (_REMEDY + ", and call it with cache=False") if sampler else \
            "check the forward path from these parameters to the loss"
        diagnosis.findings.append(Finding("", unreached, cause, remedy))
    return diagnosis


def checkpoint_plan_text(*models: torch.nn.Module) -> str:
    """The ``budget:<size>`` or ``peak:<size>`` checkpoint policy's plan for the blocks of ``models`` (of
    every model if none): one table each; ``""`` under another policy."""
    from gradpatch import settings
    if not (settings.is_budget(settings.checkpoint_policy) or settings.is_peak(settings.checkpoint_policy)):
        return ""
    from gradpatch.checkpointing.budget import checkpoint_plan

    plans = [checkpoint_plan(model) for model in models] if models else [checkpoint_plan()]
    return "\n".join(str(plan) for plan in plans if plan)


@contextlib.contextmanager
def grad_doctor(*models: torch.nn.Module, file=None) -> Iterator[Diagnosis]:
    """Wrap one training step (forward and backward); print the diagnosis of ``models`` after it, or
    one line saying that every parameter that requires grad got a gradient.

    If the step raises, the diagnosis is printed and attached to the exception as a note, and the
    exception propagates. The yielded :class:`Diagnosis` is filled in when the block ends.
    """
    diagnosis = Diagnosis()
    stream = file if file is not None else sys.stderr
    with watching() as watch:
        watch.snapshot(models)
        try:
            yield diagnosis
        except RuntimeError as error:
            for model in models:
                diagnosis.findings += explain_grads(model, error, watch).findings
            if diagnosis:
                print(diagnosis, file=stream)
                if hasattr(error, "add_note"):  # Python 3.11+
                    error.add_note(str(diagnosis))
            raise
        for model in models:
            found = explain_grads(model, None, watch)
            diagnosis.findings += found.findings
            diagnosis.trainable += found.trainable
    print(diagnosis if diagnosis else healthy_line(diagnosis.trainable, len(models)), file=stream)
    plan = checkpoint_plan_text(*models)
    if plan:
        print(f"gradpatch doctor: {plan}", file=stream)
