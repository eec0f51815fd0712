"""``gradpatch doctor SCRIPT``: run a script, diagnosing every model it trains after each backward.

The models are the outermost modules called before a backward (not blocks recomputed during it) and
the modules a patched sampler ran on with ``cache=True``; see :func:`run_script`.
"""
from __future__ import annotations

import os
import runpy
import sys
import weakref
from typing import Any

import torch

from gradpatch.doctor.watch import watching
from gradpatch.doctor.diagnosis import checkpoint_plan_text, explain_grads
from gradpatch.doctor.findings import healthy_line


def run_script(path: str, argv: list[str]) -> None:
    """Run a Python script, diagnosing every model it trains after each backward (``gradpatch doctor``).

    The script runs as ``python path ARGS`` would run it: as ``__main__``, with ``sys.argv`` set and its
    folder first on ``sys.path`` (so it imports its sibling modules). A missing file exits with status 2
    and a message. The models are found as the outermost modules called before a backward; findings
    are printed once, and so is one line the first time a backward leaves no such parameter without a
    gradient.
    """
    if not os.path.isfile(path):
        print(f"gradpatch doctor: cannot run {path!r}: no such file", file=sys.stderr)
        raise SystemExit(2)

    roots: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
    depth = [0]
    seen: set[str] = set()
    in_backward = [0]
    said = [False]  # whether the healthy line was printed

    def before(module: torch.nn.Module, _args: object) -> None:
        # Blocks recomputed during backward (checkpoints) are not models: they run at depth 0 there.
        if depth[0] == 0 and not in_backward[0] and torch._C._current_autograd_node() is None:
            roots.add(module)
        depth[0] += 1

    def after(_module: torch.nn.Module, _args: object, _output: object) -> None:
        depth[0] = max(depth[0] - 1, 0)

    def models() -> list[torch.nn.Module]:
        """The outermost of the roots and of the modules a cached sampler ran on (F5's CFM, whose
        ``sample`` is not a forward): names are then paths in them."""
        found = set(roots) | {o for _, o in watch.cached_owners() if isinstance(o, torch.nn.Module)}
        inner = {m for model in found for m in model.modules() if m is not model}
        return [m for m in found if m not in inner]

    def fresh(text: str) -> bool:
        """Whether ``text`` was not seen yet; it is seen from now on."""
        new = text not in seen
        seen.add(text)
        return new

    def report(error: BaseException | None = None) -> str:
        findings = [str(f) for model in models() for f in explain_grads(model, error, watch).findings]
        text = "\n".join(f for f in findings if fresh(f))
        # A failing backward carries the diagnosis as a note, which its traceback prints: printing it
        # here too would show it twice.
        if text and (error is None or not hasattr(error, "add_note")):
            print("gradpatch doctor:\n" + text, file=sys.stderr)
        elif error is None and not findings and not said[0]:  # the first healthy step says so, once
            found = models()
            trainable = sum(p.requires_grad for m in found for p in m.parameters())
            if trainable:  # a model it examined: else it has nothing to vouch for
                print(healthy_line(trainable, len(found)), file=sys.stderr)
                said[0] = True
        plan = checkpoint_plan_text(*roots)
        head = plan.partition("\n")[0]
        if plan and ": measuring" not in head and head not in seen:  # each finished plan once
            seen.add(head)
            print(f"gradpatch doctor: {plan}", file=sys.stderr)
        return text

    original_backward = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> None:
        watch.snapshot(models())
        in_backward[0] += 1
        try:
            original_backward(*args, **kwargs)
        except RuntimeError as error:
            text = report(error)
            if text and hasattr(error, "add_note"):
                error.add_note("gradpatch doctor:\n" + text)
            raise
        finally:
            in_backward[0] -= 1
        report()

    handles = [torch.nn.modules.module.register_module_forward_pre_hook(before),
               torch.nn.modules.module.register_module_forward_hook(after)]
    # Tensor.backward calls torch.autograd.backward through the module attribute.
    torch.autograd.backward = backward
    sys.argv = [path, *argv]
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    try:
        with watching() as watch:
            runpy.run_path(path, run_name="__main__")
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
        torch.autograd.backward = original_backward
        for handle in handles:
            handle.remove()
