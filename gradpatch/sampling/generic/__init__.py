"""gradpatch.differentiable for any sampler: any_sampler (the public function, torch-free), call (one call),
gradoff (the sampler's grad-off managers made inert), copy_on_write (in-place writes), coroutine (async
samplers)."""

from typing import Any


def __getattr__(name: str) -> Any:
    # gradpatch.sampling.generic.call was a module before it was this package (one release): its names
    # (make, patched, call, ...) come from gradpatch.sampling.generic.call, with a DeprecationWarning.
    if name.startswith("__"):
        raise AttributeError(name)
    import importlib
    import warnings

    call = importlib.import_module("gradpatch.sampling.generic.call")

    if not hasattr(call, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"gradpatch.sampling.generic.{name} is deprecated and will be removed in the next release; "
                  f"import it from gradpatch.sampling.generic.call", DeprecationWarning, stacklevel=2)
    return getattr(call, name)
