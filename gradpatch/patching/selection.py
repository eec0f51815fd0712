"""Which patches a list of names means: names of patches or of upstream packages, in any case, with
``-`` or ``_``; a string or any iterable of strings."""
from __future__ import annotations

from typing import Any, Iterable

from gradpatch.errors import ConfigWarning, complain
from gradpatch.patching.patch import Patch


def name_list(values: Iterable[object], argument: str) -> tuple[str, ...]:
    """Names from ``values``, each a string or an iterable of strings (``apply("a", ["b", "c"])``)."""
    names: list[str] = []
    for value in values:
        items: list[Any] | None = [value] if isinstance(value, str) else None
        if items is None:
            try:
                items = list(value)  # type: ignore[call-overload]
            except TypeError:
                items = [value]
        for bad in (item for item in items if not isinstance(item, str)):
            raise TypeError(f"{argument} takes patch or upstream names: a string or an iterable of strings, "
                            f"not {type(bad).__name__} ({bad!r})")
        names += items
    return tuple(names)


def _normalise(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def select(patches: dict[str, Patch], names: Iterable[object] = (), exclude: object = (), *,
           source: str = "apply()", exclude_source: str = "exclude") -> tuple[list[Patch], list[Patch]]:
    """``(selected, excluded)`` patches for names of patches or of upstream packages.

    ``names`` holds strings or iterables of strings; ``exclude`` is a string or an iterable of
    strings. No names means every patch. Unknown names are reported (with the closest known name) and
    ignored; anything but strings raises TypeError.
    """
    vocabulary = {_normalise(p.name) for p in patches.values()} | {_normalise(p.upstream) for p in patches.values()}

    def matching(requested: Iterable[str], source: str) -> set[str]:
        chosen: set[str] = set()
        for raw in requested:
            name = _normalise(raw)
            if not name:
                continue
            hits = {p.name for p in patches.values() if name in (_normalise(p.name), _normalise(p.upstream))}
            if not hits:
                import difflib

                close = difflib.get_close_matches(name, sorted(vocabulary), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                complain(ConfigWarning, f"gradpatch: unknown patch {raw!r} in {source}; {hint}"
                         "`gradpatch list` shows every patch and upstream name",
                         once=source.startswith("GRADPATCH"))  # the environment is read by every apply()
            chosen |= hits
        return chosen

    names = name_list(names, source)
    exclude = name_list((exclude,), exclude_source)
    wanted = matching(names, source) if names else set(patches)
    dropped = matching(exclude, exclude_source)
    selected = [p for p in patches.values() if p.name in wanted and p.name not in dropped]
    excluded = [p for p in patches.values() if p.name in wanted and p.name in dropped]
    return selected, excluded
