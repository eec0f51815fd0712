"""The grad-off constructs of a sampler's own code, made inert for one :func:`gradpatch.differentiable` call.

While a call is active in a context (thread, task), and only there, torch's grad-off managers ask who
entered them. ``torch.no_grad()``, ``torch.inference_mode()`` (mode True) and
``torch.set_grad_enabled(False)`` do nothing when they are entered by *the sampler's code*: a
decorator of any function the call reaches (torch's ``decorate_context``/``generator_context``, also
behind wrappers that are not ``functools.wraps``-based), or a ``with`` block in a frame that is not
inside a network nor inside the caller's code. A network is a frame running ``forward`` of an
``nn.Module`` that is neither the target's own code nor itself decorated grad-off (Matcha's
``CFM.forward`` is a sampler): inside one, everything runs as written. The caller's code is a callable
passed in as an argument (:attr:`Call.user`: callbacks, ``denoised_fn``, ``cond_fn``): inside it, and in
whatever it calls, the caller's grad-off constructs are honoured (recorded in :attr:`Call.honoured` for
messages). torch's and gradpatch's own code are never touched. The frames are read up to the call's
boundary (:data:`BOUNDARY` code objects), so a checkpoint recompute, a generator or coroutine resumed
by the caller and a task the sampler's code submits to a ``concurrent.futures.ThreadPoolExecutor``
(run in a copy of the call's context, with the submitting thread's grad mode) are classified like the
forward call. Threads started otherwise have no call in their context: torch's own behaviour there.

Refused with :class:`~gradpatch.errors.NotDifferentiableError` (message: what and where): a grad-off
manager held in a variable and entered by the sampler (``ctx = torch.no_grad(); with ctx:``: it may be
shared with code that means it), and a ``@contextmanager`` whose name holds ``ema`` (``ema_scope``: the
samples would come from EMA weights swapped in with ``.data`` copies, not from the parameters being
trained). ``nn.Module.train`` (so ``eval()``) called by the sampler's code is a no-op: the caller's
train/eval modes hold during the call; so are the own ``train``/``eval`` of the module classes in
:attr:`Call.classes` (a LoRA layer's merge never runs).

The managers are patched at class level while at least one call is active (reference counted, under a
lock); in every other context the patched methods run torch's own code.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dis
import functools
import sys
import threading
from contextvars import ContextVar
from types import CodeType, FrameType
from typing import Any, Callable, Iterator

import torch
from torch.autograd import grad_mode

from gradpatch.errors import NotDifferentiableError


class Call:
    """One active call: the target's code objects (its frames are the sampler's, also when it is a
    ``forward``), the code objects of the callables passed in (the caller's: honoured), the module
    classes whose own ``train``/``eval`` the sampler's code must not run, and a name for messages."""

    def __init__(self, where: str, codes: frozenset[CodeType], user: frozenset[CodeType] = frozenset(),
                 classes: frozenset[type] = frozenset()) -> None:
        self.where, self.codes, self.user, self.classes = where, codes, user, classes
        self.honoured: list[str] = []  # where the caller's callbacks entered a grad-off manager


_active: ContextVar[Call | None] = ContextVar("gradpatch_differentiable_call", default=None)
BOUNDARY: set[CodeType] = set()  # code objects of gradpatch's frames that start a call (generic.py adds)


def _generator() -> Iterator[None]:
    yield


# torch 2.15 renames each decorated function's code after its manager (co_name "inference_mode"): one per manager.
_DECORATORS = frozenset(manager()(body).__code__ for manager in (torch.no_grad, torch.inference_mode)
                        for body in (lambda: None, _generator))


def _where(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)})"


def _network(frame: FrameType, call: Call) -> bool:
    if frame.f_code.co_name != "forward" or frame.f_code in call.codes:
        return False
    if not isinstance(frame.f_locals.get("self"), torch.nn.Module):
        return False
    return frame.f_back is None or frame.f_back.f_code not in _DECORATORS


def _owner(frame: FrameType | None, call: Call) -> str:
    """Whose code ``frame`` runs: ``"sampler"`` (the boundary is above it, with no network and no code of
    the caller's between), ``"user"`` (a callable the caller passed in is between) or ``"other"``."""
    while frame is not None:
        code = frame.f_code
        if code in BOUNDARY:
            return "sampler"
        if code in call.user or (code in _DECORATORS and getattr(frame.f_locals.get("func"), "__code__", None)
                                 in call.user):
            return "user"
        if _network(frame, call):
            return "other"
        frame = frame.f_back
    return "other"


def in_sampler(frame: FrameType | None, call: Call) -> bool:
    """Whether ``frame`` runs the sampler's code: the boundary is above it and no network, and no
    callable the caller passed in, between."""
    return _owner(frame, call) == "sampler"


_opcodes: dict[CodeType, tuple[dict[int, int], list[str]]] = {}
_WITH_MACHINERY = frozenset({"LOAD_SPECIAL", "COPY", "SWAP", "PUSH_NULL", "NOP", "CACHE"})  # 3.14's with


def _fresh(frame: FrameType) -> bool:
    """Whether the ``with`` being entered in ``frame`` made its manager by a call (``with f():``), not
    from a variable or attribute (``with ctx:``): the instruction that produced it is a call."""
    code = frame.f_code
    if code not in _opcodes:
        instructions = list(dis.get_instructions(code))
        _opcodes[code] = ({ins.offset: i for i, ins in enumerate(instructions)}, [ins.opname for ins in instructions])
    index, names = _opcodes[code]
    at = index.get(frame.f_lasti)
    if at is None:
        return True  # not a layout this knows: lift, as for a fresh manager
    at -= 1
    while at >= 0 and names[at] in _WITH_MACHINERY:
        at -= 1
    return at < 0 or names[at].startswith(("CALL", "PRECALL"))


def _lift(frame: FrameType, what: str, *, check_fresh: bool = True) -> bool:
    """Whether the grad-off manager ``frame`` is entering belongs to the sampler's code."""
    call = _active.get()
    if call is None:
        return False
    decorated = frame.f_code in _DECORATORS
    owner = frame.f_locals.get("func") if decorated else None
    module = getattr(owner, "__module__", None) if decorated else frame.f_globals.get("__name__")
    if str(module or "").partition(".")[0] in ("torch", "gradpatch"):
        return False
    whose = _owner(frame, call)
    if whose == "user":
        code = getattr(owner, "__code__", None)
        call.honoured.append(f"{code.co_filename}:{code.co_firstlineno} (@{what} on {code.co_qualname})"
                             if decorated and code is not None else f"{_where(frame)} ({what})")
    if whose != "sampler":
        return False
    if check_fresh and not decorated and not _fresh(frame):
        raise NotDifferentiableError(
            f"gradpatch.differentiable({call.where}): a {what} manager held in a variable is entered at "
            f"{_where(frame)}; gradpatch lifts only managers made where they are entered (`with {what}():` "
            "or a decorator), since a shared one may be meant. Make it there, or call the sampler's "
            "parts yourself under torch.enable_grad()")
    return True


_ORIGINAL: dict[str, Callable[..., Any]] = {
    "no_grad.__enter__": grad_mode.no_grad.__enter__, "no_grad.__exit__": grad_mode.no_grad.__exit__,
    "inference_mode.__enter__": grad_mode.inference_mode.__enter__,
    "inference_mode.__exit__": grad_mode.inference_mode.__exit__,
    "set_grad_enabled.__init__": grad_mode.set_grad_enabled.__init__,
    "train": torch.nn.Module.train, "gcm.__enter__": contextlib._GeneratorContextManager.__enter__,
    "submit": concurrent.futures.ThreadPoolExecutor.submit,
}


def _no_grad_enter(self: Any) -> None:
    if _active.get() is not None and _lift(sys._getframe(1), "torch.no_grad()"):
        self.__dict__["_gradpatch_lifted"] = True
        return None
    return _ORIGINAL["no_grad.__enter__"](self)


def _no_grad_exit(self: Any, *exc: Any) -> None:
    if self.__dict__.pop("_gradpatch_lifted", False):
        return None
    return _ORIGINAL["no_grad.__exit__"](self, *exc)


def _inference_enter(self: Any) -> None:
    if _active.get() is not None and self.mode and _lift(sys._getframe(1), "torch.inference_mode()"):
        self.__dict__["_gradpatch_lifted"] = True
        return None
    return _ORIGINAL["inference_mode.__enter__"](self)


def _inference_exit(self: Any, *exc: Any) -> None:
    if self.__dict__.pop("_gradpatch_lifted", False):
        return None
    return _ORIGINAL["inference_mode.__exit__"](self, *exc)


def _set_grad_enabled_init(self: Any, mode: bool) -> None:
    if _active.get() is not None and not mode and _lift(sys._getframe(1), "torch.set_grad_enabled", check_fresh=False):
        self.prev, self.mode = torch.is_grad_enabled(), torch.is_grad_enabled()  # entering/exiting changes nothing
        return None
    return _ORIGINAL["set_grad_enabled.__init__"](self, mode)


def _train(self: Any, mode: bool = True) -> Any:
    call = _active.get()
    if call is not None and in_sampler(sys._getframe(1), call):
        return self  # the caller's modes hold (eval() calls train(False))
    return _ORIGINAL["train"](self, mode)


@functools.lru_cache(maxsize=4096)
def _ema(name: str) -> bool:  # a generator's name names an EMA scope (ema_scope)
    return "ema" in name.lower().split("_")


def _gcm_enter(self: Any) -> Any:
    call = _active.get()
    name = getattr(getattr(getattr(self, "gen", None), "gi_code", None), "co_name", "")
    if call is not None and _ema(name) and in_sampler(sys._getframe(1), call):
        raise NotDifferentiableError(
            f"gradpatch.differentiable({call.where}): {name}() at {_where(sys._getframe(1))} swaps EMA weights "
            "into the model (copies through .data, invisible to autograd), so the graph would be built on "
            "weights that are swapped back afterwards and the gradients would be wrong. Call the sampler "
            "on the model without its EMA scope (e.g. the method it calls inside the scope)")
    return _ORIGINAL["gcm.__enter__"](self)


def _submit(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    call = _active.get()
    if call is not None and in_sampler(sys._getframe(1), call):  # the sampler's work, in the call's context
        context = contextvars.copy_context()
        return _ORIGINAL["submit"](self, context.run, _worker, torch.is_grad_enabled(), fn, args, kwargs)
    return _ORIGINAL["submit"](self, fn, *args, **kwargs)


def _worker(grad: bool, fn: Any, args: tuple, kwargs: dict) -> Any:  # a boundary: the pool thread's share
    with torch.set_grad_enabled(grad):  # the submitting thread's mode (a new thread's own is on)
        return fn(*args, **kwargs)


BOUNDARY.add(_worker.__code__)
_PATCHES = [(grad_mode.no_grad, "__enter__", _no_grad_enter), (grad_mode.no_grad, "__exit__", _no_grad_exit),
            (grad_mode.inference_mode, "__enter__", _inference_enter),
            (grad_mode.inference_mode, "__exit__", _inference_exit),
            (grad_mode.set_grad_enabled, "__init__", _set_grad_enabled_init), (torch.nn.Module, "train", _train),
            (contextlib._GeneratorContextManager, "__enter__", _gcm_enter),
            (concurrent.futures.ThreadPoolExecutor, "submit", _submit)]
_lock = threading.Lock()
_users = 0
_overrides: dict[tuple[type, str], list[Any]] = {}  # (class, "train"/"eval") -> [users, original, ours]


def _guarded(original: Any) -> Any:
    """A module class's own ``train``/``eval``, a no-op when the sampler's code calls it (its side
    effects, a LoRA merge, never run), the original everywhere else."""

    @functools.wraps(original)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _active.get()
        if call is not None and in_sampler(sys._getframe(1), call):
            return self
        return original(self, *args, **kwargs)

    return guarded


def _guard(classes: frozenset[type], delta: int) -> None:  # under _lock
    for owner in classes:
        for name in ("train", "eval"):
            if name not in vars(owner) and (owner, name) not in _overrides:
                continue
            entry = _overrides.get((owner, name))
            if entry is None and delta > 0:
                entry = _overrides[(owner, name)] = [0, vars(owner)[name], _guarded(vars(owner)[name])]
                setattr(owner, name, entry[2])
            if entry is None:
                continue
            entry[0] += delta
            if entry[0] == 0:
                del _overrides[(owner, name)]
                if vars(owner).get(name) is entry[2]:
                    setattr(owner, name, entry[1])


@contextlib.contextmanager
def active(call: Call) -> Iterator[None]:
    """Make ``call`` the active call of this context, with the managers patched, for the block."""
    global _users
    with _lock:
        if _users == 0:
            for (owner, name, ours), key in zip(_PATCHES, _ORIGINAL):
                _ORIGINAL[key] = vars(owner)[name]  # whatever is there now (another library's, too)
                setattr(owner, name, ours)
        _users += 1
        _guard(call.classes, 1)
    token = _active.set(call)
    try:
        yield
    finally:
        _active.reset(token)
        with _lock:
            _guard(call.classes, -1)
            _users -= 1
            if _users == 0:
                for (owner, name, ours), key in zip(_PATCHES, _ORIGINAL):
                    if vars(owner).get(name) is ours:
                        setattr(owner, name, _ORIGINAL[key])
