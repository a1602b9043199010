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
dtype, the interventions (`with_memory_of`) and the check that a state fed to a model is one it could have
made (`misfit`); a family writes no walker of its own.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Iterator
from typing import Annotated, TypeAlias, TypeVar

import torch
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


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What `misfit` compares a tensor with: a fresh state's tensor, without its numbers."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: Tensor) -> TensorSpec:
        return cls(tuple(t.shape), t.dtype, t.device)


@dataclasses.dataclass(frozen=True)
class NoneOr:
    """A spec part that may be None or must fit `spec` (Titans' weights: None until their first update)."""

    spec: object


def spec_of(state: Part) -> Part:
    """`state` with each tensor replaced by its `TensorSpec` (what `misfit` compares against, holding no memory)."""
    return tree_map_only(Tensor, TensorSpec.of, state)


def misfit(state: object, template: object, path: str = "state", sizes: bool = True) -> str | None:
    """Where `state` does not fit `template`, a fresh state of the same model and batch (`spec_of`): the first part
    whose type, length, keys, dtype, device or shape differs (with `sizes` off: its layout alone), as "path: what";
    None where it fits. A tensor empty in the template is a cache that grows along its dimensions of size 0, the
    others fixed; a None in the template may hold anything, a `NoneOr` None or what fits its spec."""
    if template is None or (state is None and not sizes):  # a layout: a memory not written yet fits either side
        return None
    if isinstance(template, NoneOr):
        return None if state is None else misfit(state, template.spec, path, sizes)
    if isinstance(template, TensorSpec):
        if not isinstance(state, Tensor):
            return f"{path}: a {type(state).__name__}, this model's a tensor"
        if not sizes:
            return None
        shape = tuple(state.shape)
        if state.dtype != template.dtype:
            return f"{path}: {state.dtype}, this model's {template.dtype}"
        if state.device.type != template.device.type:
            return f"{path}: on {state.device}, this model's on {template.device}"
        grows = math.prod(template.shape) == 0
        if len(shape) != len(template.shape) or any(a != b for a, b in zip(shape, template.shape) if b or not grows):
            return f"{path}: shape {shape}, this model's {template.shape}" + (" (it grows)" if grows else "")
        return None
    if type(state) is not type(template):
        return f"{path}: a {type(state).__name__}, this model's a {type(template).__name__}"
    names = field_names(template)
    if names:
        return next(
            (m for n in names if (m := misfit(getattr(state, n), getattr(template, n), f"{path}.{n}", sizes))), None
        )
    if isinstance(template, (list, tuple)):
        assert isinstance(state, (list, tuple))  # the same type as the template
        if len(state) != len(template):
            return f"{path}: {len(state)} parts, this model's {len(template)}"
        return next(
            (m for i, (a, b) in enumerate(zip(state, template)) if (m := misfit(a, b, f"{path}[{i}]", sizes))), None
        )
    if isinstance(template, dict):
        assert isinstance(state, dict)
        if set(state) != set(template):
            return f"{path}: keys {sorted(state)}, this model's {sorted(template)}"
        return next((m for k in template if (m := misfit(state[k], template[k], f"{path}[{k!r}]", sizes))), None)
    return None  # a StateValue or a plain value of the template's type
