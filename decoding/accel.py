"""Faster implementations of decoding/ functions, plugged in from outside.

decoding/ never imports an outer layer. A pure function here that has a
Triton kernel in kernels/ calls ``dispatch(name, reference, *args)``;
``kernels.install()`` registers each kernel with a test of the tensors it
applies to (CUDA, or CPU under ``TRITON_INTERPRET=1``), and the outer layers
call it once per process (the CLI, the model workers, Serve replicas, Tune
trials). Without a registration, or where it does not apply, the torch
reference runs.

>>> calls = []
>>> register("double", lambda x: calls.append(x) or 2 * x, applies=lambda x: x > 10)
>>> dispatch("double", lambda x: x, 3), dispatch("double", lambda x: x, 20), calls
(3, 40, [20])
>>> unregister("double")
"""

from __future__ import annotations

from collections.abc import Callable

_IMPLS: dict[str, tuple[Callable[..., bool], Callable]] = {}
# input rows (tokens of a step) up to which a registered fast linear or attention kernel runs (kernels/cpu_int4.py: a
# 3072x576 projection takes 351 us against the dense GEMM's 376 at 64 rows, 697 against 641 at 128, on 2 threads);
# within it every token gets the bits it gets alone, whatever the rows and tokens beside it
FAST_MAX_ROWS = 64


def register(name: str, fn: Callable, applies: Callable[..., bool]) -> None:
    """Use ``fn`` for ``name`` on the arguments for which ``applies(*args)`` is true."""
    _IMPLS[name] = (applies, fn)


def unregister(name: str) -> None:
    _IMPLS.pop(name, None)


def registered() -> list[str]:
    return sorted(_IMPLS)


def registered_impl(name: str) -> tuple[Callable[..., bool], Callable] | None:
    """(applies, fn) as registered for ``name``, or None (a test that unregisters it puts it back with this)."""
    return _IMPLS.get(name)


def has(name: str) -> bool:
    """Whether an implementation of ``name`` is registered (it may still not apply to given arguments)."""
    return name in _IMPLS


def pick(name: str, reference: Callable, *args) -> Callable:
    """What :func:`dispatch` would call for these arguments, chosen once for many calls alike (a forward's layers).

    >>> register("double", lambda x: 2 * x, applies=lambda x: x > 10)
    >>> pick("double", abs, 20)(3), pick("double", abs, -3)(-3)
    (6, 3)
    >>> unregister("double")
    """
    impl = _IMPLS.get(name)
    return impl[1] if impl is not None and impl[0](*args) else reference


def dispatch(name: str, reference: Callable, *args):
    impl = _IMPLS.get(name)
    if impl is not None and impl[0](*args):
        return impl[1](*args)
    return reference(*args)
