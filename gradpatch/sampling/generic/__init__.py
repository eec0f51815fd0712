"""gradpatch.differentiable for any sampler: any_sampler (the public function, torch-free), callables (what
it returns; a string target's fix), call (one call),
gradoff (the sampler's grad-off managers made inert), copy_on_write (in-place writes; held: what it holds
of the tensors saved; unwatched: the step's later evaluations without it), coroutine (async samplers)."""

from typing import Any

_SUBMODULES = frozenset({"any_sampler", "call", "callables", "copy_on_write", "coroutine", "gradoff", "held",
                         "unwatched"})


def __getattr__(name: str) -> Any:
    # gradpatch.sampling.generic was a module before it was this package (one release): its names
    # (make, patched, call, ...) come from gradpatch.sampling.generic.callables and .call, with a
    # DeprecationWarning.
    if name.startswith("__"):
        raise AttributeError(name)
    import importlib
    import warnings

    if name in _SUBMODULES:  # `from gradpatch.sampling.generic import gradoff` asks here before importing it
        return importlib.import_module(f"{__name__}.{name}")

    for where in ("gradpatch.sampling.generic.callables", "gradpatch.sampling.generic.call"):
        module = importlib.import_module(where)
        if hasattr(module, name):
            warnings.warn(f"gradpatch.sampling.generic.{name} is deprecated and will be removed in the next "
                          f"release; import it from {where}", DeprecationWarning, stacklevel=2)
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
