"""The words of an :class:`~gradpatch.UnknownCodeWarning`: why gradpatch left a module alone (its
fingerprint matches no known version, something else was found where the target should be, or the
code cannot be read) and, for an unknown fingerprint, how to adopt it. The
:class:`~gradpatch.patching.ledger.Ledger` decides when to warn (once per module); this module only
words it."""
from __future__ import annotations

from typing import Iterable, Mapping

from gradpatch.patching import adoption
from gradpatch.patching.patch import Patch


def is_fingerprint(label: str) -> bool:
    """Whether an identity's ``label`` is a fingerprint (16 hex digits) rather than a description."""
    return len(label) == 16 and all(c in "0123456789abcdef" for c in label)


def left_alone_message(module: str, left: list[Patch], unknown: str | None, unreadable: str | None,
                       known: Mapping[str, Patch], copies: Iterable[str] = ()) -> str:
    """Why ``module`` was left alone, naming the wanted patches on it (``left``): code ``unknown``
    (a fingerprint, or what was found instead), or code that cannot be read (``unreadable``).
    ``known`` and ``copies`` (the adopted copies' names) choose the ``like=`` of the adopt advice."""
    names = ", ".join(patch.name for patch in left)
    if unknown is not None and is_fingerprint(unknown):
        return (f"gradpatch: {module} does not match any known version (fingerprint {unknown}), so "
                f"gradpatch left it alone ({names}). " + adoption.advice(left, known, copies) + ".")
    if unknown is not None:  # no fingerprint to add: say what was found instead
        wrapped = "not the module's own definition" in unknown
        return (f"gradpatch: {module} was left alone ({names}): {unknown}. gradpatch replaces only code it "
                "recognises" + ("; to have it patched, remove the wrapper (an import hook that wraps every "
                                "function, such as jaxtyping's install_import_hook, can be told to leave this "
                                "module out)" if wrapped else ""))
    return f"gradpatch: cannot recognise {module}, so gradpatch left it alone ({names}): {unreadable}."
