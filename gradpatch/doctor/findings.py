"""What the doctor prints: a :class:`Finding` (a module, its parameters left without a gradient, the
cause and the fix, wrapped at :data:`WIDTH` columns), the :class:`Diagnosis` of a step (its findings),
and the one line of a healthy step (:func:`healthy_line`). Plain text: nothing here needs torch."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

#: What a diagnosis with no finding says: the one line of a healthy step.
HEALTHY = "gradpatch doctor: every trainable parameter got a gradient"
WIDTH = 100


def wrap(text: str, first: str, rest: str) -> str:
    """``text`` after ``first``, wrapped at :data:`WIDTH` under ``rest`` (a path is never split)."""
    lines = textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                          break_on_hyphens=False)
    if lines and len(lines[0]) > WIDTH:  # its first word does not fit beside the label: below it
        lines = [first.rstrip()] + textwrap.wrap(text, WIDTH, initial_indent=rest, subsequent_indent=rest,
                                                 break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines) or first.rstrip()


@dataclass(frozen=True)
class Finding:
    """A group of parameters under one module that share a cause. ``frozen``: the parameters do not
    require grad (those a broken checkpoint's backward raised on), and are labelled so."""

    module: str
    parameters: tuple[str, ...]
    cause: str
    remedy: str
    frozen: bool = False

    def __str__(self) -> str:
        names = ", ".join(self.parameters[:4]) + (f" and {len(self.parameters) - 4} more" if len(self.parameters) > 4 else "")
        if names and self.frozen:
            names += " (frozen)"
        head = wrap(names, f"- {self.module or '<root>'}: ", "    ") if names else f"- {self.module or '<root>'}"
        return f"{head}\n{wrap(self.cause, '    cause: ', ' ' * 11)}\n{wrap(self.remedy, '    fix:   ', ' ' * 11)}"


@dataclass
class Diagnosis:
    findings: list[Finding] = field(default_factory=list)
    trainable: int = 0  # parameters that require grad, over the models diagnosed

    def __bool__(self) -> bool:
        return bool(self.findings)

    def __str__(self) -> str:
        if not self.findings:
            return healthy_line(self.trainable)
        return "gradpatch doctor:\n" + "\n".join(map(str, self.findings))


def healthy_line(trainable: int, models: int = 1) -> str:
    """The one line of a step after which every parameter that requires grad got a gradient."""
    what = f"{trainable} tensor{'s' if trainable != 1 else ''}" + (f" in {models} models" if models > 1 else "")
    return f"{HEALTHY} ({what})" if trainable else f"{HEALTHY.partition(':')[0]}: no parameter requires grad"
