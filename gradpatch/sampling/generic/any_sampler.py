"""``gradpatch.differentiable``: gradients through a sampler no catalogue knows.

Two forms::

    sample = gradpatch.differentiable(model.sample, step="estimator", steps="n_timesteps")
    x = sample(mu, mask, n_timesteps=10)                    # cache=False: a graph
    x = sample(mu, mask, n_timesteps=10, grad_steps=2)      # a graph through the last 2 steps only

    gradpatch.differentiable("matcha.models.components.flow_matching:BASECFM.forward",
                             step="estimator", steps="n_timesteps")
    x = cfm(mu, mask, n_timesteps=10, cache=False)          # patched in place; cache=True is upstream

**The callable form** ``differentiable(fn, step=None, steps=None)`` takes a function or a bound method
and returns a callable with ``fn``'s arguments plus, keyword-only, ``cache`` (default ``False``: it
exists to differentiate), ``grad_steps`` and ``checkpoint_steps``, validated as every patched sampler's
(:mod:`gradpatch.sampling.options`: ``cache="False"`` or ``0`` is a TypeError). ``cache=True`` is ``fn``'s
own call. ``step`` is what one sampler step calls, once: a module (its ``forward``, however it is
called), a bound method, a function the sampler's module names, or the name of an attribute of the
sampler's object or of an argument (``"estimator"``, ``"model"``, dotted ``"model.unet"``); needed for
``checkpoint_steps``. ``steps`` names the argument holding the number of steps (its default used when
not passed; dotted, ``"self.num_timesteps"``, reads an attribute), or is a callable receiving the
bound arguments; needed for ``grad_steps``.

**The string form** ``differentiable("module:Qual.name", step=..., steps=...)`` patches that attribute
in place, now if the module is imported, else the moment it is (a :class:`~gradpatch.patching.patch.Patch`
of upstream ``differentiable``, as if declared in the catalogue). The replacement takes the same
keywords with ``cache=True`` by default (upstream's call, bitwise). It is listed in
:func:`gradpatch.report` and undone by :func:`gradpatch.revert` (the original object back). It returns
the patch's record. This is also how an unknown version of a catalogued target is opted in.

**During a** ``cache=False`` **call, and only in its context** (thread, task):

* Gradients flow through every grad-disabling construct *the sampler's code* enters (lifted): ``no_grad``
  and ``inference_mode`` decorators at every level the call reaches (also behind decorators that are
  not ``functools.wraps``-based, such as imagen's ``eval_decorator``), in-body ``with`` blocks and
  ``torch.set_grad_enabled(False)``, generators that ``yield`` inside a grad-off block (the caller's
  code between items runs in the caller's own grad mode), ``async def`` samplers (each resumption runs
  in the call's context; other tasks run in theirs between awaits), the sampler object's own
  methods passed as arguments, and tasks it hands to a ``concurrent.futures.ThreadPoolExecutor``
  (``submit``/``map``: run in a copy of the call's context, with the submitting thread's grad mode).
  Nothing is rewritten: torch's managers do nothing when the sampler's code enters them
  (:mod:`gradpatch.sampling.generic.gradoff`).
* Honoured (torch's behaviour), everywhere else:

  - the caller's own ``no_grad``/``inference_mode`` around the call (no graph);
  - the networks it calls: inside a module's ``forward`` a ``no_grad`` (a deliberate stop-gradient, a
    renormalisation) stays. A ``forward`` that is itself decorated grad-off is treated as sampler code
    (Matcha's ``CFM.forward`` is a sampler); pass such a frozen network's output through
    ``.detach()`` yourself if it must stay frozen;
  - code the caller passes in as an argument (a callback, ``denoised_fn``, ``cond_fn``, a
    ``functools.partial``, a callable object, also in a list, tuple or dict, three levels down) and
    everything it calls: what a
    ``@torch.no_grad()`` logging callback stores carries no graph. A callable made differentiable
    with :func:`differentiable` and passed in is lifted by its own call. If the result then carries no
    graph, the error names the callback's grad-off block;
  - threads started otherwise (``threading.Thread``, ``multiprocessing``'s ``ThreadPool``), other
    threads and tasks, torch's and gradpatch's own code.
* ``self.eval()`` (any ``train()``) called by the sampler's code does nothing, on every module
  reachable from the sampler's object, ``step`` or the arguments, submodules included, and also when a
  class defines its own ``train``/``eval`` (loralib merging LoRA weights: never run); the train/eval
  flags of the sampler's object and of ``step`` are put back on exit: the caller's modes hold. A module
  the call attaches to them (imagen rebuilds ``self.unets``) takes its parent's mode.
* In-place writes (``x_in[:B] = x``, ``x += v * dt``) give the gradients of the out-of-place
  computation (:mod:`gradpatch.sampling.generic.copy_on_write`, copy on write of tensors saved for backward).
* Inference tensors never leak out: they are cloned into normal tensors in what the call returns or
  yields, and in what ``step`` returns.

``grad_steps=K``: a graph only through the last K of N steps (N from ``steps``): grad is off from the
first ``step`` call until the ``step`` call N-K returns, so the latent entering step N-K carries no
graph (DRaFT-K); what the sampler computes before its first step keeps its graph. A ``step`` called
other than exactly N times raises RuntimeError. ``checkpoint_steps=True``: each ``step`` call is
recomputed in backward (non-reentrant checkpoint) from its inputs as they were, even if the sampler
overwrote them since; a nested call of ``step`` inside a step (CFG calling ``forward`` twice) is part
of it. The caller's grad mode is restored at the end of the call.

**Refused** with :class:`~gradpatch.errors.NotDifferentiableError`, saying what and where: an EMA
weight swap (a ``@contextmanager`` named ``ema_scope`` or ``*_ema_*``), a grad-off manager held in a
variable, a result that left torch (``.cpu().numpy()``, ``None`` because it was written to a file:
anything returned with no tensor carrying a graph while something required grad).

**Costs.** Every torch call of the sampler passes through one Python ``__torch_function__`` mode (copy
on write), and every tensor saved for backward through a Python pack hook; the ``step``'s evaluations
after its first two recorded ones run without them where copy on write had nothing to do
(:mod:`~gradpatch.sampling.generic.unwatched`). Measured on CPU (``benchmarks/differentiable_overhead.py``)
at 1.7x the time of the same sampler written by hand for a tiny width-64 MLP, 1.2x at width 256, 1.04x
at width 1024, 1.2x on Chatterbox's and Matcha's tiny decoders and 1.05x on Chatterbox's S3Gen decoder
at its real size; the overhead is per torch call, so it shrinks as the network grows. Tensors saved for
backward and overwritten later are copied once.
The grad-off managers are patched at class level while a call is active (other contexts run torch's
own code). ``checkpoint_steps`` costs a second forward of each step.

**What breaks.** Writes torch does not dispatch (``.data`` copies, C++ extensions) into tensors saved
for backward raise in backward, and so do a write of the ``step``'s own into a tensor saved and a refill
of what it saved, made only after its first two recorded evaluations (where copy on write had nothing
to do, so later ones run unwatched); so does any write into a tensor saved for backward under
``torch.func.grad`` or ``torch.autograd.graph.disable_saved_tensors_hooks`` (no copy-on-write hooks
there: the call runs, torch's own version check raises). ``torch._C._set_grad_enabled(False)`` called
directly is not seen.
Code compiled with ``torch.compile`` inside the call may graph-break at the mode. A network that caches
a tensor across steps (F5-TTS's text embedding with ``cache=True``) computes it in the first step: with
``grad_steps`` that step is not recorded, so the cached tensor is a constant in the last K steps and
its parameters get no gradient; with ``checkpoint_steps`` a recompute may find the cache cleared and
raise ``CheckpointError``. Turn such caches off for the call (the catalogued F5 fix does).

**In the catalogue.** A codebase entry in ``patches/`` declares a sampler made differentiable this way
with :func:`sampler` as its fix (recognised by fingerprint like any other)::

    from gradpatch.sampling.generic.any_sampler import sampler
    from gradpatch.patching.fingerprint import Fingerprints
    from gradpatch.patching.patch import Patch

    PATCHES = [
        Patch("matcha.cfm", "matcha.models.components.flow_matching:BASECFM.forward",
              sampler(step="estimator", steps="n_timesteps"),
              Fingerprints({"0123456789abcdef": "matcha-tts 0.0.7.2"}), "matcha",
              "BASECFM.forward(cache=False): gradients through the Euler solve", "matcha-tts"),
    ]

Importing this module does not import torch. (It is not named ``differentiable``: importing a
submodule of that name would rebind ``gradpatch.differentiable`` to the module.)
"""
from __future__ import annotations

import types
from typing import Any, Callable
from urllib.parse import quote, unquote

from gradpatch.patching.fingerprint import Identity

UPSTREAM = "differentiable"


def _encode(value: str | None) -> str:
    return "" if value is None else quote(value, safe="").replace(".", "%2E")


def sampler(step: str | None = None, steps: str | None = None) -> str:
    """The ``fix`` of a :class:`~gradpatch.patching.patch.Patch` whose target is made differentiable by
    :func:`differentiable` with these ``step``/``steps`` (names, as in the string form)."""
    for name, value in (("step", step), ("steps", steps)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"a declared {name}= must be a name (str), not {value!r}")
    return f"{__name__}:fix.step={_encode(step)};steps={_encode(steps)}"


class _Fixes:
    """``fix.<encoded options>``: the fix factory :func:`sampler`'s string names."""

    def __getattr__(self, encoded: str) -> Callable[[object], object]:
        options = dict(part.partition("=")[::2] for part in encoded.split(";"))
        if set(options) != {"step", "steps"}:
            raise AttributeError(encoded)
        step, steps = (unquote(options[k]) or None for k in ("step", "steps"))

        def factory(original: object) -> object:
            from gradpatch.sampling.generic.callables import patched

            return patched(original, step, steps, where=_name(original))

        return factory


fix = _Fixes()


def _name(original: object) -> str:
    """The qualified name messages give: the decorated function's, through wrappers that copied a
    decorator's inner name (``functools.wraps`` over imagen's ``eval_decorator.<locals>.inner``)."""
    obj = getattr(original, "__func__", original)
    name = getattr(obj, "__qualname__", None) or repr(original)
    for _ in range(8):
        if "<locals>" not in name:
            break
        inner = getattr(obj, "__wrapped__", None)
        if inner is None:  # a wrapper that is not wraps-based: the one function its closure holds
            cells = [_content(c) for c in getattr(obj, "__closure__", None) or ()]
            functions = [f for f in cells if isinstance(f, types.FunctionType)]
            inner = functions[0] if len(functions) == 1 else None
        if inner is None:
            break
        obj, name = inner, getattr(inner, "__qualname__", name)
    return name


def _content(cell: object) -> object:
    try:
        return cell.cell_contents  # type: ignore[attr-defined]
    except ValueError:  # an empty cell
        return None


class Requested:
    """The recogniser of a target named in :func:`differentiable`'s string form: known on request."""

    def identify(self, module: object, qualname: str, original: object) -> Identity:
        return Identity("known", "requested with gradpatch.differentiable")


def differentiable(target: Any, step: Any = None, steps: Any = None) -> Any:
    """Gradients through ``target``'s sampling (see the module docstring for the whole contract).

    ``target`` is a function or bound method (returns the differentiable callable, ``cache=False`` by
    default) or ``"module:Qual.name"`` (patches it in place, ``cache=True`` by default; returns the
    :class:`~gradpatch.patching.patch.Record`). ``step``: what one sampler step calls (for
    ``checkpoint_steps``); ``steps``: the argument holding the number of steps (for ``grad_steps``).
    """
    if isinstance(target, str):
        module, _, qualname = target.partition(":")
        if not module or not qualname or " " in target:
            raise ValueError(f"gradpatch.differentiable: a target is 'package.module:Qual.name', not {target!r}")
        for name, value in (("step", step), ("steps", steps)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"gradpatch.differentiable({target!r}): with a string target, {name}= is a name "
                                f"(an attribute of the object or an argument), not {value!r}")
        from gradpatch.patching.activation import request
        from gradpatch.patching.patch import Patch

        return request(Patch(f"{UPSTREAM}:{target}", target, sampler(step, steps), Requested(), UPSTREAM,
                             f"made differentiable on request (step={step}, steps={steps})"))
    if not callable(target):
        raise TypeError(f"gradpatch.differentiable: {target!r} is neither callable nor 'module:Qual.name'")
    from gradpatch.sampling.generic.callables import make

    return make(target, step, steps, cache=False)


__all__ = ["differentiable", "sampler"]
