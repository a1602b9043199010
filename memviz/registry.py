"""The family registry: one `Family` record per memory family, the only place the rest of the
workbench (tracing, figures, interventions, training presets, the app) learns what a family is.

A family is one unit (one folder under `memviz/models/` or `families/`, or a user's own file): its model class
(the math, its options dataclass and its state), decorated with `register_family`, which records
  * `hooks`: the generic hook names traced by default, each with its trace reducer;
  * `hook_docs`: every hook of the family's default model, each with its shape and meaning (the class's
    `hook_docs`; `python -m memviz hooks` makes docs/hooks.md's table from them);
  * `figures`: `(trace, zoom) -> {title: figure}`, reading only the trace (its arrays and the
    `figure_settings` the trace kept), so a saved trace plots without the model;
  * `figure_settings`: `model -> dict`, what the figures need that the arrays do not say;
  * `matrix_state`: the paths, in a layer's state, of its matrix memories [batch, (head,) rows, columns] ("S",
    "memory.M", "memory.params": every tensor under a path), whose rank `memviz.state_rank` follows over a text;
  * `read_at`: `(trace, position) -> {title: figure}`, what the memory read at one token (the chunks LongMem
    retrieved, the values a memory layer selected), from the trace alone, for a family whose trace keeps it;
  * `interventions`: the intervention points, {name: `Intervention`}: "reset" and "patch" edit the
    memory fields of the carried state at a segment boundary (`memviz.interventions`); a point that acts
    through hooks (a memory layer's "silence") says where it can act and which hooks do it;
  * `quick`: the small model of a quick training run (config fields, and "lr" where the
    family needs another learning rate than the others);
  * `tiny`: the smallest config that builds (config fields beside the tests' shared small sizes), used by
    the tests' small models of every family; None only for a family not built from a config;
  * `sample`: the sample checkpoint that shows it, a name in sample_checkpoints/ or the folder a
    package ships it in (then listed and loaded under the family's name); `role`: "memory",
    "baseline" or "control";
  * `from_config`: whether `build_model` makes the family's model from a `ModelConfig` (a fresh, trainable
    model); False for a family whose models come only from another library's checkpoint folder (a released
    model loaded through transformers), which the Train page, quick presets and config tests leave out;
  * `readout`: whether its models decompose a memory read exactly over the tokens that wrote it
    (`memviz.protocol.ReadsOut.memory_readout`; a model may still return None for a setting without such a
    read, Titans' MLP memory); `needle_hold`: whether they say how much of a span's writes the memory still
    holds (`memviz.protocol.HoldsNeedle`); `read_lens`: whether they give the path from a memory read to the logits
    at a token, frozen there (`memviz.protocol.ReadsThrough.read_path`, which `memviz.read_lens` pushes a read and
    its writers' parts through). A capability is declared here once: the class has the method if and only if its
    family declares it, and the rest asks `reads_out(model)` / `holds_needle(model)` / `reads_through(model)`;
  * `prefix_capacity`: for a memory that frozen weights write (LongMem's bank), the memory option that
    bounds the tokens it holds ("bank_size"), so training may fill it with `data.prefix_tokens` through
    `model.backbone_prefill`; None when the family trains the weights that write its memory;
  * `folders`: for a family whose models come from another library's checkpoint folders (a released model's
    Hugging Face folder), the `FolderLoader` that says which folders it claims (config.json's `model_type`)
    and opens them; `memviz.load` asks the registry (`folder_family`), never a family by name.
The app, training and the probes ask these fields what a model can do, never the model's class.
Every model keeps `memviz.protocol.MemoryModel`; a family's class is checked for it when registered.
Nothing here imports a family by name: `memviz.models` imports every family folder beside it
(`import_family_folders`), which registers them, and an installed package declares its own under the
`memviz.families` entry point (a module that registers them when imported, such as this repository's
`families/` folder, installed as `memviz_families`, which imports each folder under it the same way),
loaded the first time a family is looked up or listed. A new family is a new folder; no list names it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import os
import pkgutil
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from memviz.config import ConfigError
from memviz.protocol import FillsPrefix, HoldsNeedle, HookDoc, MemoryModel, ReadsOut, ReadsThrough

if TYPE_CHECKING:
    import plotly.graph_objects as go
    from transformer_lens.hook_points import HookFunction

    from memviz.trace import Trace

#: a forward hook as TransformerLens takes it: (hook name, function of (value, hook))
NamedHook = tuple[str, "HookFunction"]

ROLES = ("memory", "baseline", "control")


@dataclass(frozen=True)
class Intervention:
    """An intervention point a family offers. One without `sites` edits the carried state's memory at a
    segment boundary ("reset", "patch": `memviz.interventions`); one with them acts through forward hooks:
    `sites(model)` lists where (memory-layer indices) and `hooks(model, site)` gives the hooks that do it."""

    summary: str
    sites: Callable[[MemoryModel], list[int]] | None = None
    hooks: Callable[[MemoryModel, int], list[NamedHook]] | None = None

    def __post_init__(self) -> None:
        if (self.sites is None) != (self.hooks is None):
            raise ValueError("an intervention acting through hooks needs both `sites` and `hooks`")

    @property
    def through_hooks(self) -> bool:
        return self.hooks is not None


#: what "reset" and "patch" do for a family whose state carries a memory across segments
STATE_INTERVENTIONS = {
    "reset": Intervention("put the memory back to its initial value at a segment boundary (interventions.ablate_at)"),
    "patch": Intervention(
        "put in the memory built from another text up to the same position (interventions.replace_at)"
    ),
}


class Figures(Protocol):
    """A family's figures of a trace: {title: figure}, over positions [start, stop) pooled to `width` columns."""

    def __call__(
        self, trace: Trace, width: int = ..., start: int = 0, stop: int | None = None
    ) -> dict[str, go.Figure]: ...


class ReadFigures(Protocol):
    """What a family's memory read at one token of a trace: {title: figure}."""

    def __call__(self, trace: Trace, position: int) -> dict[str, go.Figure]: ...


@dataclass(frozen=True)
class FolderLoader:
    """How a family opens another library's checkpoint folders: `model_types` {config.json's model_type: what
    memviz reads of it} (a live mapping: an architecture module adds to it) and `load(folder, device,
    **overrides) -> model`, which raises `memviz.files.CheckpointError` naming the file or field."""

    model_types: Mapping[str, str]
    load: Callable[..., MemoryModel]


@dataclass(frozen=True)
class Family:
    """Everything the workbench knows of one family (module docstring)."""

    name: str
    model: type[MemoryModel]
    summary: str
    hooks: Mapping[str, str]
    hook_docs: Mapping[str, HookDoc] = field(default_factory=dict)
    figures: Figures | None = None
    figure_settings: Callable[[MemoryModel], dict[str, Any]] = lambda model: {}
    read_at: ReadFigures | None = None
    matrix_state: tuple[str, ...] = ()
    interventions: Mapping[str, Intervention] = field(default_factory=dict)
    quick: Mapping[str, Any] | None = None
    tiny: Mapping[str, Any] | None = None
    sample: str | None = None
    role: str = "memory"
    from_config: bool = True
    readout: bool = False
    needle_hold: bool = False
    read_lens: bool = False
    prefix_capacity: str | None = None
    folders: FolderLoader | None = None

    @property
    def sample_name(self) -> str | None:
        """The name `memviz.load` and the app know the family's sample by."""
        if self.sample is None:
            return None
        return self.name if os.path.isabs(self.sample) else self.sample


FAMILIES: dict[str, Family] = {}
ENTRY_POINT_GROUP = "memviz.families"
_entry_points_loaded = False
M = TypeVar("M", bound=MemoryModel)
#: each capability a family may declare, and the method its models then have (and only then)
CAPABILITIES = {
    "readout": "memory_readout",
    "needle_hold": "needle_hold",
    "read_lens": "read_path",
    "prefix_capacity": "backbone_prefill",
}


def register_family(
    name: str,
    *,
    summary: str,
    figures: Figures | None = None,
    figure_settings: Callable[[MemoryModel], dict[str, Any]] | None = None,
    read_at: ReadFigures | None = None,
    matrix_state: tuple[str, ...] = (),
    interventions: Mapping[str, Intervention | str] | None = None,
    quick: Mapping[str, Any] | None = None,
    tiny: Mapping[str, Any] | None = None,
    sample: str | None = None,
    role: str = "memory",
    from_config: bool = True,
    readout: bool = False,
    needle_hold: bool = False,
    read_lens: bool = False,
    prefix_capacity: str | None = None,
    folders: FolderLoader | None = None,
) -> Callable[[type[M]], type[M]]:
    """Class decorator: register a model class as family `name` (module docstring). The hooks
    are the class's `memory_hooks`; `interventions` defaults to reset and patch of the state (a plain
    string is the summary of a state edit)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {list(ROLES)}, got {role!r}")
    points = {
        point: what if isinstance(what, Intervention) else Intervention(what)
        for point, what in (STATE_INTERVENTIONS if interventions is None else interventions).items()
    }

    def decorate(cls: type[M]) -> type[M]:
        if name in FAMILIES:
            raise ValueError(f"family {name!r} registered twice")
        if inspect.isabstract(cls):
            missing = sorted(getattr(cls, "__abstractmethods__", ()))
            raise ValueError(f"family {name!r}: {cls.__name__} does not say {missing} of the model contract")
        declarations = {
            "readout": readout,
            "needle_hold": needle_hold,
            "read_lens": read_lens,
            "prefix_capacity": prefix_capacity is not None,
        }
        for capability, declared in declarations.items():
            method = CAPABILITIES[capability]
            if declared != callable(getattr(cls, method, None)):
                raise ValueError(
                    f"family {name!r} {'declares' if declared else 'does not declare'} {capability} but "
                    f"{cls.__name__} {'lacks' if declared else 'has'} `{method}`: declare a capability with its method"
                )
        options = getattr(cls, "Options", None)
        if prefix_capacity is not None and prefix_capacity not in {
            f.name for f in (dataclasses.fields(options) if dataclasses.is_dataclass(options) else ())
        }:
            raise ValueError(f"prefix_capacity {prefix_capacity!r} is not one of family {name!r}'s memory options")
        setattr(cls, "family", name)  # noqa: B010  (the class answers `model.family`; mypy knows no such attribute on M)
        FAMILIES[name] = Family(
            name=name,
            model=cls,
            summary=summary,
            hooks=dict(getattr(cls, "memory_hooks", {})),
            hook_docs=dict(getattr(cls, "hook_docs", {})),
            figures=figures,
            figure_settings=figure_settings or (lambda model: {}),
            read_at=read_at,
            matrix_state=tuple(matrix_state),
            interventions=points,
            quick=quick,
            tiny=tiny,
            sample=sample,
            role=role,
            from_config=from_config,
            readout=readout,
            needle_hold=needle_hold,
            read_lens=read_lens,
            prefix_capacity=prefix_capacity,
            folders=folders,
        )
        return cls

    return decorate


def folder_family(model_type: object) -> Family | None:
    """The family whose `folders` claim a checkpoint folder with this config.json `model_type`, or None."""
    if not isinstance(model_type, str):
        return None
    claiming = [f for f in registered() if f.folders and model_type in f.folders.model_types]
    if len(claiming) > 1:
        raise ValueError(f"model_type {model_type!r} is claimed by families {[f.name for f in claiming]}; one must")
    return claiming[0] if claiming else None


def folder_model_types() -> dict[str, str]:
    """Every model_type some family's folders claim: {model_type: what memviz reads of it}."""
    return {t: what for f in registered() if f.folders for t, what in f.folders.model_types.items()}


def unregister_family(name: str) -> None:
    """Forget a family (a test's or a notebook's own, defined again)."""
    FAMILIES.pop(name, None)


def import_family_folders(package: str, path: Iterable[str], *, skip_broken: bool = False) -> None:
    """Import every module and subpackage of `package` (its `__path__`) in name order, so each registers
    its families; test modules (`test_*`) and private ones (`_*`) are left out. With `skip_broken`, one
    that fails to import is skipped with a warning naming it (a plug-in folder must not take the others down)."""
    for found in sorted(pkgutil.iter_modules(path), key=lambda module: module.name):
        if found.name.startswith(("test_", "_")):
            continue
        try:
            importlib.import_module(f"{package}.{found.name}")
        except Exception as exc:
            if not skip_broken:
                raise
            warnings.warn(f"memviz: the family folder {package}.{found.name} did not load: {exc}", stacklevel=2)


def load_entry_points() -> None:
    """Import the modules installed packages declare under the `memviz.families` entry point
    (once); one that fails to import is skipped with a warning naming it."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception as exc:  # a broken plug-in must not take the built-in families down
            warnings.warn(
                f"memviz: the family entry point {entry.name!r} ({entry.value}) did not load: {exc}", stacklevel=2
            )


def registered() -> list[Family]:
    """Every family, installed packages' included, in registration order."""
    load_entry_points()
    return list(FAMILIES.values())


def get_family(name: str) -> Family:
    """The registered family `name` (built-in families register when `memviz.models` is
    imported; installed packages' on the first lookup of a name not yet known)."""
    if name not in FAMILIES:
        load_entry_points()
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known families are {sorted(FAMILIES)}")
    return FAMILIES[name]


def reads_out(model: MemoryModel) -> ReadsOut | None:
    """`model`, typed as one that decomposes its memory's reads, if its family declares `readout`; else None."""
    return cast(ReadsOut, model) if get_family(model.family).readout else None


def reads_through(model: MemoryModel) -> ReadsThrough | None:
    """`model`, typed as one that gives the path from its memory's reads to its logits, if its family declares
    `read_lens`; else None."""
    return cast(ReadsThrough, model) if get_family(model.family).read_lens else None


def holds_needle(model: MemoryModel) -> HoldsNeedle | None:
    """`model`, typed as one that says how much of a span its memory holds, if its family declares `needle_hold`."""
    return cast(HoldsNeedle, model) if get_family(model.family).needle_hold else None


def fills_prefix(model: MemoryModel) -> FillsPrefix | None:
    """`model`, typed as one whose frozen backbone fills its memory, if its family declares `prefix_capacity`."""
    return cast(FillsPrefix, model) if get_family(model.family).prefix_capacity is not None else None
