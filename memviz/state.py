"""Typed model state: what a model carries from one chunk to the next, and the one walker over it.

Each part of a state is a NamedTuple (a pytree as it stands; a dataclass works too once registered
with `torch.utils._pytree.register_dataclass`), nested as the family likes, in lists and dicts too.
A field typed `Memory[...]` holds memory: what the "reset" and "patch" interventions replace, whole.
Every other field is kept by them: a local attention's key/value cache (`memviz.layers.LocalCache`),
a convolution's last inputs, or a part whose own fields say what in it is memory. For example

    class LeakyState(NamedTuple):
        local: LocalCache      # cache: kept
        m: Memory[Tensor]      # memory: reset to init_state's value, or patched from another run

A leaf that is a value object with tensors of its own (LongMem's `ChunkBank`) is a `StateValue`:
mapped over as a whole (its methods return new values), its tensors counted.

The functions here serve streaming (`ModelState.detach`, `clone`, `nbytes`), casts to the model's
dtype, and the interventions (`with_memory_of`); a family writes no walker of its own.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import typing
from collections.abc import Callable, Iterator
from typing import Annotated, TypeAlias, TypeVar

from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only, tree_unflatten

T = TypeVar("T")
Part = TypeVar("Part")  # a state or a part of one, whose type the walker keeps


class MemoryMark:
    """What `Memory[...]` adds to a field's type."""

    def __repr__(self) -> str:
        return "MEMORY"


MEMORY = MemoryMark()
#: a state field that holds memory (module docstring): Memory[Tensor], Memory[InfiniMemory], ...
Memory: TypeAlias = Annotated[T, MEMORY]


class StateValue(abc.ABC):
    """A state leaf that is a value object holding tensors of its own: appending or trimming gives a
    new value, so the walker neither maps nor rebuilds it; `tensors` says what it holds."""

    @abc.abstractmethod
    def tensors(self) -> list[Tensor]:
        """The tensors this value holds (for a state's size)."""


#: a model's state or any part of it: NamedTuples (tuples) of parts, lists and dicts of parts, tensors
State: TypeAlias = "tuple | Tensor | StateValue | list[State] | dict[str, State] | None"


def field_names(part: object) -> tuple[str, ...]:
    """The fields of a NamedTuple or dataclass state part; () for anything else."""
    if isinstance(part, tuple) and hasattr(part, "_fields"):
        return part._fields
    if dataclasses.is_dataclass(part) and not isinstance(part, type):
        return tuple(f.name for f in dataclasses.fields(part))
    return ()


@functools.cache
def memory_fields(cls: type) -> frozenset[str]:
    """The fields of a state class typed `Memory[...]`."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return frozenset(
        name for name, hint in hints.items() if typing.get_origin(hint) is Annotated and MEMORY in hint.__metadata__
    )


def map_tensors(fn: Callable[[Tensor], Tensor], state: Part) -> Part:
    """`state` with `fn` applied to every tensor leaf (a `StateValue` is left as it is)."""
    return tree_map_only(Tensor, fn, state)


def tensors_of(state: State) -> Iterator[Tensor]:
    """Every tensor `state` holds, those inside `StateValue`s included."""
    for leaf in tree_leaves(state):
        if isinstance(leaf, Tensor):
            yield leaf
        elif isinstance(leaf, StateValue):
            yield from leaf.tensors()


def with_memory_of(state: Part, donor: Part) -> Part:
    """`state` with every `Memory` field, at any depth, taken from `donor` (a state of the same layout);
    every other field (caches) stays `state`'s, and a part with no memory in it stays the same object.
    A memory field is taken whole, so the two sides may hold different things there (Titans' weights:
    None before the first update)."""
    names = field_names(state)
    if names:
        cls: type = type(state)
        marked = memory_fields(cls)
        parts = {
            name: getattr(donor, name) if name in marked else with_memory_of(getattr(state, name), getattr(donor, name))
            for name in names
        }
        if all(parts[name] is getattr(state, name) for name in names):
            return state
        if isinstance(state, tuple):
            return state._replace(**parts)  # type: ignore[attr-defined]
        return dataclasses.replace(state, **parts)  # type: ignore[type-var]
    children, layout = tree_flatten(state, is_leaf=lambda part: part is not state)  # one level down
    if layout.is_leaf():
        return state
    donor_children, _ = tree_flatten(donor, is_leaf=lambda part: part is not donor)
    swapped = [with_memory_of(a, b) for a, b in zip(children, donor_children)]
    return state if all(a is b for a, b in zip(swapped, children)) else tree_unflatten(swapped, layout)
