"""The one contract of every differentiable sampler: ``cache``, ``grad_steps``, ``checkpoint_steps``.

Every sampler gradpatch makes differentiable is one :func:`sampler_entry` around its family's ``run``:
the catalogued fixes (F5/E2 ``sample``, k-diffusion and stable-audio-tools sampler functions, the
latent-diffusion family's entry points, diffusers pipelines, imagen, the flow-matching family) and
:func:`gradpatch.differentiable` in both forms. The entry alone decides, in this order:

1. **Values.** ``cache`` is ``True`` or ``False`` (``"False"``, ``0``: TypeError); ``grad_steps`` is
   None, a positive integer (``2.5``, ``"2"``, ``True``: TypeError; ``0``, ``-1``: ValueError) or a
   range ``(lo, hi)`` of two positive integers with ``lo <= hi`` (``(1, 2, 3)``, ``(1.0, 2)``:
   TypeError; ``(0, 2)``, ``(3, 2)``: ValueError); ``checkpoint_steps`` is a boolean or
   ``"budget:<size>"`` or ``"peak:<size>"`` (``"yes"``, ``1``: TypeError; ``"budget:-1MiB"``: ValueError). Values are checked
   before anything else, so ``grad_steps=2.5`` alone is a TypeError everywhere, whatever ``cache`` is.
   A range is randomized truncation (AlignProp): each ``cache=False`` call draws its K once, uniformly
   in ``[lo, hi]`` (both ends included), before it runs, from the ``generator=`` it is given when that
   is one ``torch.Generator`` (a seeded generator reproduces noise and K together), else from torch's
   default generator (``torch.manual_seed`` reproduces it); the call then runs as with
   ``grad_steps=K``, so every family takes it. ``(k, k)`` draws nothing: it is ``grad_steps=k``.
2. **Misspelt options.** A keyword the sampler does not take by name that is close to one of the three
   (``grad_step=``, ``checkpoint_step=``, ``cahce=``) gives one :class:`~gradpatch.errors.ConfigWarning`
   naming the intended option (:class:`~gradpatch.errors.GradpatchError` in strict mode) and is removed;
   the call goes on without it. Never upstream's "unexpected keyword argument", never swallowed by a
   sampler's ``**kwargs``.
3. **Joining.** A sampler called with none of the three options while a ``cache=False`` call records a
   graph in this context (thread, task) continues that call instead of starting an upstream one: its
   grad-off constructs are lifted and the outer call's options apply to it, once. A sampler of the same
   family continues the same run (``sample_log`` calling ``DDIMSampler.sample``; ``super().__call__``);
   a catalogued sampler inside a :func:`gradpatch.differentiable` call runs its own steps with the
   outer options (it knows its steps; it switches its caches off as when called with ``cache=False``)
   and the outer call's ``step`` stands aside meanwhile; its evaluations count for the outer call.
4. **Defaults.** Otherwise ``cache`` defaults to ``True`` (upstream's call, bitwise: the original
   object, decorators and all) for every catalogued sampler and for
   ``differentiable("module:Qual.name")``, and to ``False`` for ``differentiable(fn)``, which exists to
   differentiate. ``cache=True`` with ``grad_steps`` or ``checkpoint_steps`` is a ValueError.
5. **Refusal.** A sampler that cannot give gradients (ONNX pipelines, LDM's ``generate_sample*``) raises
   :class:`~gradpatch.errors.NotDifferentiableError` naming why, for ``cache=False``, for either option,
   and where it would join a ``cache=False`` call.
6. **Had no effect.** A ``cache=False`` call given ``grad_steps`` or ``checkpoint_steps`` in which no
   denoiser evaluation went through them raises RuntimeError ("... had no effect ..."), with what the
   family expected, rather than return a graph that ignored them.
7. **Signature.** The wrapper's signature is the original's plus the three options, keyword-only,
   before ``**kwargs`` (for ``help()`` and IDEs).

What the options do once a call runs (the graph, ``grad_steps``' cut, ``checkpoint_steps``' recompute)
is :mod:`gradpatch.sampling.run`'s; how each family finds its steps is the family module's.
"""
from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Optional, Protocol

from gradpatch.errors import ConfigWarning, NotDifferentiableError, complain
from gradpatch.sampling.options import OPTIONS, SamplingOptions, check_flag, note_cached_call, step_budget, \
    step_peak

__all__ = ["UNSET", "FamilyRun", "sampler_entry", "validate", "with_options", "misspelt", "accepted_keywords"]

UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<default>", "__reduce__": lambda self: "UNSET"})()
"""The default of ``cache`` in every wrapper: "not passed" (the family's default, or joining)."""


class FamilyRun(Protocol):
    """A family's ``cache=False`` call: run ``args``/``kwargs`` under ``run`` (a fresh
    :class:`~gradpatch.sampling.run.SamplingRun` of the family, its options set) and return the output.
    ``outer`` is the call it joins (rule 3), or None."""

    def __call__(self, run: Any, outer: Any, args: tuple, kwargs: dict, /) -> Any: ...


def validate(cache: Any, grad_steps: Any, checkpoint_steps: Any, default_cache: bool) -> tuple[bool, SamplingOptions]:
    """Rules 1 and 4: the values' types and ranges first, then ``cache=True`` with an option.
    Returns the effective ``cache`` and the options."""
    if cache is not UNSET:
        check_flag("cache", cache)
    options = SamplingOptions(grad_steps, bool(checkpoint_steps), step_budget(checkpoint_steps),
                              step_peak=step_peak(checkpoint_steps))
    flag = default_cache if cache is UNSET else bool(cache)
    if flag and (options.truncates or options.checkpoint_steps):
        raise ValueError("grad_steps and checkpoint_steps control the graph built with cache=False; "
                         "with cache=True no graph is built. Pass cache=False as well.")
    return flag, options


def accepted_keywords(function: Callable[..., Any]) -> frozenset[str] | None:
    """The keywords ``function`` takes by name (None if its signature cannot be read)."""
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def misspelt(kwargs: dict[str, Any], accepted: frozenset[str] | None, where: str) -> dict[str, Any]:
    """Rule 2: ``kwargs`` without the keywords that look like a misspelt option (each reported)."""
    if not kwargs:
        return kwargs
    kept = dict(kwargs)
    for key in kwargs:
        if key in OPTIONS or (accepted is not None and key in accepted):
            continue
        close = difflib.get_close_matches(key.lower(), OPTIONS, n=1, cutoff=0.75)
        if close:
            complain(ConfigWarning, f"gradpatch: {where} got {key}=, which it does not take; did you mean "
                     f"{close[0]}=? The call goes on without it.")
            del kept[key]
    return kept


def with_options(signature: inspect.Signature, default_cache: bool = True) -> inspect.Signature:
    """Rule 7: ``signature`` plus the three options, keyword-only, before ``**kwargs``."""
    P = inspect.Parameter
    params = [p for p in signature.parameters.values() if p.name not in OPTIONS]
    extra = [P("cache", P.KEYWORD_ONLY, default=default_cache, annotation="bool"),
             P("grad_steps", P.KEYWORD_ONLY, default=None, annotation="int | tuple[int, int] | None"),
             P("checkpoint_steps", P.KEYWORD_ONLY, default=False, annotation="bool | str")]
    at = next((i for i, p in enumerate(params) if p.kind is P.VAR_KEYWORD), len(params))
    return signature.replace(parameters=params[:at] + extra + params[at:])


def sampler_entry(original: Callable[..., Any], run: Optional[FamilyRun], *, family: str,
                  describe: Callable[[tuple], str], default_cache: bool = True,
                  accepted: frozenset[str] | None = None, refusal: str | None = None,
                  expected: str = "no denoiser evaluation went through gradpatch's run_step",
                  owner: Callable[[tuple, dict], Any] | None = None) -> Callable[..., Any]:
    """The sampler every family exposes (module docstring): ``cache=True`` calls ``original``;
    ``cache=False`` calls ``run``. ``family`` names the family (rule 3), ``describe(args)`` the sampler
    in messages (``"CFM.sample"``), ``accepted`` the keywords the sampler takes by name (rule 2; default:
    ``original``'s), ``refusal`` why ``cache=False`` cannot work (rule 5: ``run`` is then unused),
    ``expected`` what rule 6's message says was missing, ``owner(args, kwargs)`` the sampler's object for
    the doctor's observers (default: the first argument)."""
    from gradpatch.sampling.run import SamplingRun, current, recording

    names = accepted_keywords(original) if accepted is None else accepted
    object_of = owner or (lambda args, kwargs: args[0] if args else None)

    @functools.wraps(original)
    def sampler(*args: Any, cache: Any = UNSET, grad_steps: Any = None, checkpoint_steps: Any = False,
                **kwargs: Any) -> Any:
        where = describe(args)
        flag, options = validate(cache, grad_steps, checkpoint_steps, default_cache)
        kwargs = misspelt(kwargs, names, where)
        outer = current.get() if cache is UNSET and grad_steps is None and checkpoint_steps is False else None
        if outer is not None and recording():
            if refusal is not None:
                raise NotDifferentiableError(f"{where} cannot continue the cache=False call it was called in: "
                                             f"{refusal}")
            inner = SamplingRun(outer.options, family=family, parent=outer)  # outer.joined once it is active
            return run(inner, outer, args, kwargs)  # type: ignore[misc]
        if flag:
            note_cached_call(where, object_of(args, kwargs))
            return original(*args, **kwargs)
        if refusal is not None:
            raise NotDifferentiableError(f"{where} cannot run with cache=False: {refusal}")
        this = SamplingRun(options.drawn(kwargs.get("generator")), family=family)  # rule 1: a range's K
        if options.step_peak is not None:  # learns the call's plan from earlier calls (steps.peak)
            from gradpatch.sampling.steps import peak as step_peak_plan

            out = step_peak_plan.call(this, original, args, kwargs, lambda: run(this, None, args, kwargs))  # type: ignore[misc]
        else:
            out = run(this, None, args, kwargs)  # type: ignore[misc]
        if (options.truncates or options.checkpoint_steps) and this.evaluations == 0 \
                and not inspect.isgenerator(out):  # a generator's steps run as it is consumed
            raise RuntimeError(f"{where}: grad_steps/checkpoint_steps had no effect: {expected}")
        return out

    try:
        sampler.__signature__ = with_options(inspect.signature(original), default_cache)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pass
    sampler.__wrapped__ = original  # type: ignore[attr-defined]
    return sampler
