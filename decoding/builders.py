"""The methods' drafter builders: each is registered beside the drafter it builds, and the engine reads them.

``decoding.methods`` declares the methods (names, knobs, schedules, how they run on actors) and imports no drafter.
The module that defines a method's drafter registers its builder with :func:`builds`; ``decoding.in_process`` imports
those modules, so wherever a decoder is built every method has its builder. Ground level: imports nothing of the
project but ``decoding.errors``.

A builder is ``(cfg, target, device, memory) -> Drafter | None``: ``cfg`` a ``SpecConfig``, ``target`` the loaded
target (``decoding.model.loading.LoadedModel``), ``device`` where a separate draft model goes, ``memory`` the
decoder's ``DraftMemory`` (model-free drafters' state across requests). It checks what depends on the model (an exit
layer below the model's depth) and returns None for no drafter (AR).

>>> @builds("example")
... def _example(cfg, target, device, memory):
...     return None
>>> builder_of("example") is _example
True
>>> del BUILDERS["example"]
>>> builder_of("example")
Traceback (most recent call last):
...
decoding.errors.ConfigError: method: no drafter builder is registered for 'example' (decoding.in_process imports the drafters' modules)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from decoding.errors import ConfigError

if TYPE_CHECKING:
    from decoding.config import SpecConfig
    from decoding.drafters.draft_memory import DraftMemory
    from decoding.model.loading import LoadedModel

    # returns a decoding.drafters.base.Drafter or None; base registers the ``ar`` builder here, so this module does
    # not import it back, not even for type checkers (no import circle)
    Builder = Callable[[SpecConfig, LoadedModel, object, DraftMemory | None], object]

BUILDERS: dict[str, Builder] = {}  # method name -> its drafter builder


def builds(*methods: str) -> Callable[[Builder], Builder]:
    """Register the decorated function as the drafter builder of ``methods`` (a module imported again re-registers)."""

    def register(fn: Builder) -> Builder:
        for name in methods:
            BUILDERS[name] = fn
        return fn

    return register


def builder_of(method: str) -> Builder:
    """The drafter builder registered for ``method``."""
    try:
        return BUILDERS[method]
    except KeyError:
        raise ConfigError(
            "method", f"no drafter builder is registered for {method!r} (decoding.in_process imports the drafters' modules)"
        ) from None
