"""Families: known-broken definitions recognised wherever a codebase copied them.

A :class:`Family` is declared once (``patches/_families.py``): the definition names its members go
by, what each member looks like (its *shape*), the fingerprints of every known version of the
definitions hashed together, and the fix of each member. The same declaration builds the patches
of the paths a codebase is known to use (:meth:`Family.patches`, with their provenance and version
ranges) and is what :mod:`gradpatch.patching.scan` looks for in every other imported module.

A member is a module-level definition (``checkpoint``) or a method a class of the module defines
itself (``BASECFM.forward``: the flow-matching family's samplers are methods); :func:`resolve` finds
either in a module's namespace.

A shape tells a member from unrelated code that happens to use the same name:
``torch.utils.checkpoint`` defines ``checkpoint`` and ``CheckpointFunction`` too, with other
signatures. Shapes read code objects only: no ``inspect``, no torch. This module is imported at
interpreter start (under ``GRADPATCH=1``) and must stay cheap.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, Mapping, NamedTuple, Sequence

from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.patch import Patch

_VARARGS = 0x04  # inspect.CO_VARARGS


def _positional(function: object) -> tuple[tuple[str, ...], bool] | None:
    """``(positional parameter names, takes *args)`` of a plain function (through staticmethod and
    ``functools.wraps`` layers: a copy wrapped by a decorator or an import hook, such as jaxtyping's,
    keeps its shape, and is then reported as not the module's own definition), or None for anything
    else."""
    for _ in range(4):
        inner = getattr(function, "__func__", None) or getattr(function, "__wrapped__", None)
        if inner is None:
            code = getattr(function, "__code__", None)
            return None if code is None else (code.co_varnames[:code.co_argcount], bool(code.co_flags & _VARARGS))
        function = inner
    return None


def resolve(namespace: Mapping[str, object], name: str) -> object:
    """The object ``name`` (``checkpoint``, or ``Class.method`` defined in that class's own body, not
    inherited) names in a module's ``namespace``; None if there is none."""
    head, _, rest = name.partition(".")
    obj = namespace.get(head)
    for part in rest.split(".") if rest else ():
        obj = vars(obj).get(part) if isinstance(obj, type) else None
    return obj


class FunctionShape(NamedTuple):
    """A plain function (a method too, behind ``functools.wraps`` decorators such as torch's
    ``no_grad``) whose positional parameters begin with ``parameters``."""

    parameters: tuple[str, ...]

    def matches(self, obj: object) -> bool:
        found = _positional(obj) if type(obj).__name__ == "function" else None
        return found is not None and found[0][:len(self.parameters)] == self.parameters


class AutogradFunctionShape(NamedTuple):
    """A ``torch.autograd.Function`` subclass whose ``forward`` takes exactly ``forward`` then
    ``*args`` (the class's MRO is read by name: torch is never imported here)."""

    forward: tuple[str, ...]

    def matches(self, obj: object) -> bool:
        if not isinstance(obj, type) or not any(
                base.__name__ == "Function" and base.__module__.startswith("torch.autograd")
                for base in obj.__mro__[1:]):
            return False
        return _positional(vars(obj).get("forward")) == (self.forward, True)


class Member(NamedTuple):
    """One definition of a family: its ``name``, its ``shape``, and ``fix`` (``"module:factory"``,
    as in :class:`~gradpatch.patching.patch.Patch`), or None for a definition that is hashed with the
    others but never replaced (its callers are). ``marks_copy``: a module defining this member
    alone, in its shape, holds a copy (e.g. ``CheckpointFunction`` whose ``checkpoint`` was rebound);
    otherwise a module holds one when it defines every member of a fingerprinted set."""

    name: str
    shape: FunctionShape | AutogradFunctionShape
    fix: str | None = None
    summary: str = ""
    marks_copy: bool = False


class Family(NamedTuple):
    """Known-broken definitions copied between codebases, recognised by fingerprint at any path.

    ``fingerprints`` pairs each set of member names hashed together with the fingerprints of their
    known versions (fingerprint -> variant label); a module is identified by the largest set it
    defines. Callers are reached as for every patch: a module global still holding a replaced
    original (``from util import checkpoint`` copied the name) is pointed at the fix.
    """

    name: str
    members: tuple[Member, ...]
    fingerprints: tuple[tuple[tuple[str, ...], Mapping[str, str]], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(member.name for member in self.members)

    @property
    def heads(self) -> tuple[str, ...]:
        """The module-level names a module must hold to define a member (``BASECFM`` for
        ``BASECFM.forward``): the scan's cheap first test."""
        return tuple(dict.fromkeys(name.partition(".")[0] for name in self.names))

    def is_copy(self, shaped: Sequence[str]) -> bool:
        """Whether a module whose own definitions ``shaped`` have their members' shapes holds a
        copy of the family (changed or not) rather than unrelated code sharing a name."""
        return any(m.marks_copy and m.name in shaped for m in self.members) or any(
            set(over) <= set(shaped) for over, _ in self.fingerprints)

    def fixes(self) -> frozenset[str]:
        return frozenset(member.fix for member in self.members if member.fix)

    def known(self, names: Sequence[str]) -> dict[str, str]:
        """Every known fingerprint of ``names`` hashed together."""
        return dict(next((known for over, known in self.fingerprints if tuple(names) == over), {}))

    def groups(self, defined: Sequence[str]) -> list[tuple[str, ...]]:
        """The sets of names hashed together that ``defined`` covers, largest first; if none, the
        smallest set (identifying it then says which definition is missing)."""
        covering = [over for over, _ in self.fingerprints if set(over) <= set(defined)]
        smallest = min((over for over, _ in self.fingerprints), key=len)
        return sorted(covering, key=len, reverse=True) or [smallest]

    def copy_in(self, module: ModuleType, namespace: Mapping[str, object], name: str) -> list[Patch]:
        """The patches for the copy ``module`` (named ``name``, globals ``namespace``) holds, or ``[]``
        if its definitions that share a member's name are not in the members' shapes (unrelated code).
        A copy is identified by the largest set of names it defines whose fingerprint is known, else
        by the largest it defines (and then reported as unknown code)."""
        shaped = [m.name for m in self.members if getattr(resolve(namespace, m.name), "__module__", None) == name
                  and m.shape.matches(resolve(namespace, m.name))]
        if not self.is_copy(shaped):
            return []
        over = self._group(module, namespace)
        return self.patches(name.partition(".")[0], name, self.known(over), over=over, name=name)

    def _group(self, module: ModuleType, namespace: Mapping[str, object]) -> tuple[str, ...]:
        objects = tuple(resolve(namespace, name) for name in self.names)
        key = (self.name,) + tuple(id(getattr(obj, "__code__", obj)) for obj in objects)
        if key in _chosen:
            return _chosen[key][1]
        groups = self.groups([name for name, obj in zip(self.names, objects) if obj is not None])
        chosen = groups[0]
        for over in groups:
            recognise = Fingerprints(self.known(over), over=over)
            if recognise.identify(module, over[0], resolve(namespace, over[0])).verdict == "known":
                chosen = over
                break
        # The objects are kept with the key so that their ids cannot be reused by other code.
        _chosen[key] = (tuple(getattr(obj, "__code__", obj) for obj in objects), chosen)
        return chosen

    def patches(self, upstream: str, module: str, known: Mapping[str, str], *, over: Sequence[str],
                requires: str | None = None, name: str | None = None) -> list[Patch]:
        """The patches replacing every member in ``over`` that has a fix, in ``module``, recognised
        by ``known`` fingerprints of ``over``. Patch names are ``{name or upstream}.{member}``."""
        recognise = Fingerprints(dict(known), over=tuple(over))
        return [Patch(f"{name or upstream}.{member.name}", f"{module}:{member.name}", member.fix, recognise,
                      upstream, member.summary, requires)
                for member in self.members if member.fix and member.name in over]


# The set of names each copy was identified by, per family and code objects (see Family._group).
_chosen: dict[tuple, tuple[tuple[object, ...], tuple[str, ...]]] = {}


class MethodVersions(NamedTuple):
    """Methods copied between codebases one at a time, each recognised by its own known versions.

    The latent-diffusion family's samplers (``DDIMSampler.sample``, ``LatentDiffusion.p_sample_loop``)
    are whole classes copied from CompVis into AudioLDM, AudioLDM2, AudioSR, Stable Diffusion 1/2,
    ControlNet and many research repositories, with single methods edited here and there, so each method
    is recognised alone. ``versions`` maps ``"Class.method"`` (``"Class.method:variant"`` for versions
    that need another recogniser, such as a body with an in-body ``no_grad``) to its role and known
    fingerprints; ``build(upstream, {"module:Class": "method method:variant ..."}, name=...)`` turns
    names into patches (the same function declares the known paths in ``patches/``), and ``fixes`` are
    the fix strings those patches use (the scan looks for copies while one of them is wanted).

    A module holds a copy when a class it defines itself, under one of the classes' names, has a method
    whose version is known (or fixed upstream): then every method of the family that class defines gets
    its patch, so an edited method is left alone and reported while its siblings are patched. A class
    with no known method is unrelated code that shares a name, and is not touched.
    """

    name: str
    versions: Mapping[str, tuple]
    build: Callable[..., list[Patch]]
    fixes_used: frozenset[str]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.versions)

    @property
    def heads(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(name.partition(".")[0] for name in self.versions))

    def fixes(self) -> frozenset[str]:
        return self.fixes_used

    def copy_in(self, module: ModuleType, namespace: Mapping[str, object], name: str) -> list[Patch]:
        """The patches for the classes of the family ``module`` defines, or ``[]`` if none of their
        methods is a known version (see the class docstring)."""
        upstream, chosen, recognised = name.partition(".")[0], {}, False
        for head in self.heads:
            cls = namespace.get(head)
            if not isinstance(cls, type) or cls.__module__ != name:
                continue
            methods = []
            for method, variants in self._methods(head):
                original = vars(cls).get(method)
                if original is None:
                    continue
                pick = variants[0]
                for variant in variants:
                    patch, = self.build(upstream, {f"{name}:{head}": variant}, name=name)
                    if patch.recognise.identify(module, patch.qualname, original).verdict in ("known", "fixed"):
                        pick, recognised = variant, True
                        break
                methods.append(pick)
            if methods:
                chosen[f"{name}:{head}"] = " ".join(methods)
        return self.build(upstream, chosen, name=name) if recognised else []

    def _methods(self, head: str) -> list[tuple[str, list[str]]]:
        """``(method, [variant, ...])`` for the methods of class ``head``, in declaration order."""
        methods: dict[str, list[str]] = {}
        for key in self.versions:
            cls, _, method = key.partition(".")
            if cls == head:
                methods.setdefault(method.partition(":")[0], []).append(method)
        return list(methods.items())
