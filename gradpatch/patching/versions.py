"""Which installed version a patch supports: PEP 440 containment without importing ``packaging``
in the common case (this runs inside the user's ``import`` of a target)."""
from __future__ import annotations

import functools

_OPERATORS = {">=": "__ge__", "<=": "__le__", "==": "__eq__", "!=": "__ne__", ">": "__gt__", "<": "__lt__"}


def _plain(version: str) -> bool:
    return all(part.isascii() and part.isdecimal() for part in version.split("."))


def split_requirement(requires: str) -> tuple[str, str]:
    """``("f5-tts", ">=1.0,<2")`` from ``"f5-tts>=1.0,<2"``."""
    cut = next((i for i, c in enumerate(requires) if c in "<>=!~ ;,["), len(requires))
    return requires[:cut].strip(), requires[cut:].strip()


def contains(specifier: str, found: str) -> bool:
    """PEP 440 containment, prereleases included (tests check it against ``SpecifierSet``).

    This runs inside the user's ``import`` of a target, where ``packaging.specifiers`` would cost
    ~15 ms: plain release numbers compare as integer tuples, other simple clauses with
    ``packaging.version``, and only ``~=``, ``===`` and wildcards with ``SpecifierSet``."""
    clauses = [c.strip() for c in specifier.split(",") if c.strip()]
    operators = [next((op for op in (c[:2], c[:1]) if op in _OPERATORS), None) for c in clauses]
    simple = [(op, c[len(op):].strip()) for op, c in zip(operators, clauses) if op is not None]
    if len(simple) != len(clauses) or any("*" in bound for _, bound in simple):
        from packaging.specifiers import SpecifierSet  # ~=, ===, wildcards

        return SpecifierSet(specifier).contains(found, prereleases=True)
    if all(_plain(v) for v in [found] + [bound for _, bound in simple]):
        # Release numbers only (the usual case): spare importing packaging.version (~5 ms).
        width = max(len(v.split(".")) for v in [found] + [bound for _, bound in simple])
        key = lambda v: tuple(map(int, v.split("."))) + (0,) * (width - len(v.split(".")))  # noqa: E731
        return all(getattr(key(found), _OPERATORS[op])(key(bound)) for op, bound in simple)
    from packaging.version import Version

    version = Version(found)
    for op, text in simple:
        bound = Version(text)
        if op == "<" and not bound.is_prerelease:  # PEP 440: <V excludes V's pre-releases
            version_seen = Version(version.base_version)
        elif op == ">" and not bound.is_postrelease and version.is_postrelease:  # and >V its post-releases
            version_seen = Version(version.base_version)
            if version_seen == bound:
                return False
        else:
            version_seen = version
        if not getattr(version_seen, _OPERATORS[op])(bound):
            return False
    return True


@functools.lru_cache(maxsize=None)
def installed_version(requires: str | None) -> tuple[str | None, str | None]:
    """``(version, problem)``: the installed distribution's version and why it is out of range."""
    if not requires:
        return None, None
    from importlib.metadata import PackageNotFoundError, version

    name, specifier = split_requirement(requires)
    try:
        found = version(name)
    except PackageNotFoundError:
        return None, None  # a vendored copy: the fingerprint decides
    if specifier and not contains(specifier, found):
        return found, f"{name} {found} is outside the supported range {specifier}"
    return found, None
