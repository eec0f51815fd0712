"""One patch over a class hierarchy: every subclass of a base defined so far, and each one defined later.

A codebase whose pipelines all derive from one base class (diffusers' ``DiffusionPipeline``,
DiffSynth-Studio's ``BasePipeline``) is patched through ``Base.__init_subclass__``, which the base
inherits: the fix factory :func:`hierarchy_fix` builds walks the base's subclasses and lets the family's
``patch_class(cls, replace)`` replace what it wants on each class (``replace(cls, name, original,
replacement)``), then returns an ``__init_subclass__`` that does the same for every class defined later
(lazily imported, community, the user's own). The engine calls that method's ``__gradpatch_revert__``
when it removes it again: every replaced attribute still in place gets its original back; one replaced
by someone else since is left, with a :class:`~gradpatch.errors.RevertWarning`. Each replacement carries
``__gradpatch_original__``, so a family can tell its own objects from upstream's.
"""
from __future__ import annotations

from typing import Any, Callable

from gradpatch.errors import RevertWarning, complain

__all__ = ["Hierarchy", "hierarchy_fix"]

Replace = Callable[[type, str, Any, Any], None]
"""``replace(cls, name, original, replacement)``: set ``cls.name`` for the installation, revertibly."""


class Hierarchy:
    """What one installation touched, so that revert restores exactly those objects."""

    def __init__(self, base: type, patch_class: Callable[[type, Replace], None]) -> None:
        self.base, self.patch_class, self.active = base, patch_class, True
        self.touched: list[tuple[type, str, object, object]] = []

        def __init_subclass__(cls: type, **kwargs: Any) -> None:
            super(base, cls).__init_subclass__(**kwargs)  # type: ignore[arg-type]  # (base is a class)
            if self.active:
                self.patch_class(cls, self.replace)

        self.hook: Any = classmethod(__init_subclass__)

    def replace(self, cls: type, name: str, original: Any, replacement: Any) -> None:
        replacement.__gradpatch_original__ = original
        setattr(cls, name, replacement)
        self.touched.append((cls, name, original, replacement))

    def install(self) -> None:
        pending = [self.base]
        seen: set[type] = set()
        cls: type
        while pending:
            for cls in pending.pop().__subclasses__():
                if cls not in seen:
                    seen.add(cls)
                    self.patch_class(cls, self.replace)
                    pending.append(cls)

    def revert(self) -> None:
        """Called by the engine after it removed ``__init_subclass__`` from the base class."""
        self.active = False
        for cls, name, original, replacement in reversed(self.touched):
            if vars(cls).get(name) is replacement:
                setattr(cls, name, original)
            else:
                complain(RevertWarning, f"gradpatch: not reverting {cls.__qualname__}.{name}: replaced since")
        self.touched.clear()


def hierarchy_fix(patch_class: Callable[[type, Replace], None]) -> Callable[[Any], classmethod]:
    """The fix factory for ``Base.__init_subclass__``, which the base class inherits (the engine passes
    the inherited method, bound to the base): patches every class of the hierarchy defined so far with
    ``patch_class`` and returns the ``__init_subclass__`` that patches each one defined later."""

    def fix(inherited: Any) -> classmethod:
        state = Hierarchy(inherited.__self__, patch_class)
        try:
            state.install()
        except BaseException:
            state.revert()  # the engine records the failure; leave nothing half-patched
            raise
        state.hook.__gradpatch_revert__ = state.revert  # type: ignore[attr-defined]
        return state.hook

    return fix
