"""Adopting code gradpatch does not recognise: the user's word that it is a copy of catalogued code.

gradpatch replaces only code it recognises, so a vendored copy that differs from every known version
by one line is left alone with an :class:`~gradpatch.UnknownCodeWarning`. Whoever owns that copy can
say what it is: ``gradpatch.adopt("myproject.util:checkpoint", like="audioldm.checkpoint")``, or,
with no code change, ``GRADPATCH_ADOPT="myproject.util:checkpoint=audioldm.checkpoint"`` (a comma
list, read by every ``apply()``, at start-up under ``GRADPATCH=1`` too). The target then gets the fix
of the catalogued patch ``like``, as a patch of this process named after the target (upstream
``"adopted"``): its record says it was adopted and from which patch, ``revert()`` takes it out (the
original object back), and a module imported later is patched when its body runs.

The fix is put only on an object of the kind it was written for: a class for a class
(``CheckpointFunction``), a function for a function, with the parameters the fix expects where the
catalogue declares them (``checkpoint(func, inputs, params, flag)``); an object ``like``'s own
recogniser checks by other means than a fingerprint (torch's checkpoint bound under another name, a
body whose ``no_grad`` is lifted) must pass that check. Anything else is refused with one message
saying what is wrong and what to do. Torch-free, like the rest of the engine.
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import Iterable, Mapping, NamedTuple

from gradpatch.patching import watcher
from gradpatch.patching.fingerprint import Fingerprints, Identity, Recogniser
from gradpatch.patching.hooks import MISSING, locate
from gradpatch.patching.patch import Patch

#: The upstream name of every adopted patch: ``revert("adopted")`` takes them all out.
ADOPTED = "adopted"
VARIABLE = "GRADPATCH_ADOPT"


class AdoptionError(ValueError):
    """``adopt()`` was given something it cannot do: the message says what, and what to do instead."""


def _is_digest(label: str) -> bool:
    return len(label) == 16 and all(c in "0123456789abcdef" for c in label)


class Adopted(NamedTuple):
    """The recogniser of an adopted target: what is there is taken for the code ``like`` fixes, once it
    is of the kind that fix was written for (``kind``: ``"class"`` or ``"function"``; ``shape``: the
    family member's shape when the catalogue declares one). ``inner`` is ``like``'s recogniser: its
    ``fixed_if`` still says "fixed upstream", and one that checks more than a fingerprint still checks."""

    like: str
    inner: Recogniser
    kind: str
    shape: object = None

    def identify(self, module: ModuleType, qualname: str, original: object) -> Identity:
        label = f"adopted like {self.like}"
        if not hasattr(self.inner, "known"):  # e.g. IsObject: it is that object, or it is not
            found = self.inner.identify(module, qualname, original)
            if found.verdict == "unknown":
                raise AdoptionError(f"{module.__name__}:{qualname} is not what {self.like} fixes ({found.label}); "
                                    f"adopt it like a patch whose target is of its kind (`gradpatch list`)")
            return found._replace(label=f"{label} ({found.label})") if found.verdict == "known" else found
        problem = mismatch(self, original)
        if problem:
            raise AdoptionError(f"{module.__name__}:{qualname} {problem}")
        inner = self.inner._replace(known={})  # type: ignore[attr-defined]
        if isinstance(inner, Fingerprints):
            inner = inner._replace(over=())  # the target alone: its companions are the user's business
        found = inner.identify(module, qualname, original)
        if found.verdict == "fixed":
            return found
        if found.verdict == "unknown" and _is_digest(found.label):
            digest = found.label  # accepted as if catalogued (a recogniser like Liftable checks more)
            found = inner._replace(known={digest: label}).identify(module, qualname, original)
            if found.verdict == "known":
                return Identity("known", f"{label} (fingerprint {digest})")
        if isinstance(inner, Fingerprints):  # a wrapper, or no source: the user's word is enough
            return Identity("known", label)
        raise AdoptionError(f"{module.__name__}:{qualname} cannot take {self.like}'s fix: {found.label}")


def mismatch(adopted: Adopted, obj: object) -> str:
    """Why ``obj`` is not of the kind ``adopted.like``'s fix was written for, or ``""``."""
    raw = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    if adopted.kind == "class" and not isinstance(raw, type):
        return (f"is {_kind_of(raw)}, but {adopted.like} replaces a class; adopt it like a patch whose "
                "target is a function (`gradpatch list` shows them)")
    if adopted.kind == "function" and (isinstance(raw, type) or not callable(raw)):
        return (f"is {_kind_of(raw)}, but {adopted.like} replaces a function; adopt it like a patch whose "
                "target is a class (`gradpatch list` shows them)")
    shape = adopted.shape
    if shape is not None and not shape.matches(raw):  # type: ignore[attr-defined]
        wanted = tuple(getattr(shape, "parameters", None) or getattr(shape, "forward", None) or ())
        return (f"does not take the parameters {adopted.like}'s fix expects ({', '.join(wanted)}, ...); "
                "adopt it like a patch for code of its signature")
    return ""


def _kind_of(obj: object) -> str:
    return "a class" if isinstance(obj, type) else "a function" if callable(obj) else f"a {type(obj).__name__}"


def parse_target(target: object) -> tuple[str, str]:
    """``(module, qualname)`` of ``"module:Qual.name"``; :class:`AdoptionError` for anything else."""
    module, colon, qualname = target.partition(":") if isinstance(target, str) else ("", "", "")
    parts = [*module.split("."), *qualname.split(".")]
    if not colon or not all(part.isidentifier() for part in parts):
        raise AdoptionError(f"gradpatch.adopt: {target!r} is not a target: give \"module:Qual.name\", the "
                            "module's import name, a colon, and the attribute (e.g. "
                            "\"myproject.util:checkpoint\" or \"myproject.cfm:CFM.sample\")")
    return module, qualname


def _expected(like: Patch, families: Iterable[object]) -> tuple[str, object]:
    """``(kind, shape)`` of the object ``like``'s fix replaces: from the family member the catalogue
    declares with that fix, else from its name (classes are capitalised: ``CheckpointFunction``)."""
    last = like.qualname.rpartition(".")[2]
    members = [m for f in families for m in getattr(f, "members", ()) if getattr(m, "fix", None) == like.fix]
    member = next((m for m in members if m.name == like.qualname), members[0] if members else None)
    if member is not None:
        shape = member.shape
        return ("class" if hasattr(shape, "forward") else "function"), shape
    return ("class" if last[:1].isupper() and not last.isupper() else "function"), None


def build(target: object, like: object, known: Mapping[str, Patch], families: Iterable[object] = ()) -> Patch:
    """The patch putting ``like``'s fix on ``target``; :class:`AdoptionError` for a malformed target
    or a ``like`` that is not a catalogued patch's name."""
    module, qualname = parse_target(target)
    if not isinstance(like, str) or like not in known or known[like].upstream == ADOPTED:
        import difflib

        names = sorted(name for name, patch in known.items() if patch.upstream != ADOPTED)
        close = difflib.get_close_matches(str(like), names, n=1) if isinstance(like, str) else []
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise AdoptionError(f"gradpatch.adopt: like={like!r} is not a patch of the catalogue; {hint}give the "
                            "name of the patch whose code yours is a copy of (`gradpatch list` shows them, e.g. "
                            "'audioldm.checkpoint' or 'f5_tts.sample')")
    source = known[like]
    kind, shape = _expected(source, families)
    summary = f"adopted like {like}: {source.summary}"
    return Patch(f"{module}:{qualname}", f"{module}:{qualname}", source.fix,
                 Adopted(like, source.recognise, kind, shape), ADOPTED, summary)


def check_now(patch: Patch, modules: Mapping[str, object]) -> None:
    """Refuse now (:class:`AdoptionError`) a target whose module has run its body and lacks the
    attribute or holds an object of another kind. A module not imported, imported lazily and not
    loaded yet, or being imported is examined when its body has run."""
    module = modules.get(patch.module)
    if module is None or watcher.unloaded(module) or watcher.running(module):
        return
    try:
        owner, attr, original = locate(module, patch.qualname)  # type: ignore[arg-type]
    except (AttributeError, LookupError):
        raise AdoptionError(f"gradpatch.adopt: {patch.module} has no attribute {patch.qualname!r}; give the "
                            "name the code is defined under there (\"module:Qual.name\")") from None
    if original is MISSING:
        original = getattr(owner, attr)
    try:
        patch.recognise.identify(module, patch.qualname, original)  # type: ignore[arg-type]
    except AdoptionError as error:
        raise AdoptionError(f"gradpatch.adopt: {error}") from None


def from_environment(known: Mapping[str, Patch], families: Iterable[object] = (),
                     value: str | None = None) -> tuple[list[Patch], list[str]]:
    """The patches ``GRADPATCH_ADOPT`` asks for (``"module:Qual=patch[,...]"``), and one message per
    entry that cannot be adopted (it is ignored)."""
    value = os.environ.get(VARIABLE, "") if value is None else value
    patches, problems = [], []
    families = list(families)
    for entry in filter(None, (part.strip() for part in value.split(","))):
        target, equals, like = (part.strip() for part in entry.partition("="))
        try:
            if not equals:
                raise AdoptionError(f"{entry!r} has no '=PATCH'")
            patches.append(build(target, like, known, families))
        except AdoptionError as error:
            why = str(error).removeprefix("gradpatch.adopt: ")
            problems.append(f"gradpatch: {VARIABLE} entry {entry!r} is ignored: {why}; the variable takes "
                            "module:Qual.name=patch, comma-separated (e.g. myproject.util:checkpoint="
                            "audioldm.checkpoint)")
    return patches, problems


def like_of(patch: Patch, known: Mapping[str, Patch], copies: Iterable[str] = ()) -> str:
    """The catalogued patch to adopt ``patch``'s target like: ``patch`` itself when it is declared,
    else (a copy the scan found, named in ``copies``) a declared patch with the same fix on a target
    of the same name."""
    copies = set(copies)
    if patch.name not in copies and patch.upstream != ADOPTED:
        return patch.name
    same = [p for p in known.values() if p.fix == patch.fix and p.name not in copies and p.upstream != ADOPTED]
    return next((p.name for p in same if p.qualname == patch.qualname), same[0].name if same else patch.name)


def advice(patches: Iterable[Patch], known: Mapping[str, Patch], copies: Iterable[str] = ()) -> str:
    """What to write to adopt ``patches``' targets: the ``gradpatch.adopt(...)`` lines and the variable."""
    pairs = [(patch.target, like_of(patch, known, copies)) for patch in patches]
    calls = "; ".join(f'gradpatch.adopt("{target}", like="{like}")' for target, like in pairs)
    variable = ",".join(f"{target}={like}" for target, like in pairs)
    return (f"If it is a copy of the code gradpatch fixes there, adopt it after gradpatch.apply(): {calls} "
            f"(or set {VARIABLE}={variable})")
