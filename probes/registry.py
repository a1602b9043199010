"""The probe registry: one `Probe` record per probe, the one table that the command line (`python -m
memviz_probes`), the app's Probes page and notebooks read, as `memviz.registry` is for the model families.

A record holds
  * `args`: the probe's own arguments (`Arg`), which the command line makes flags of and the page widgets of;
  * which shared arguments it takes: --n/--samples and --seed unless it draws nothing (`unsampled`), --workers and
    torchrun's ranks (`workers`), more checkpoints after the first, one line each (`several`);
  * `run(model, args)`: its table, from the module's own `run`; `args` holds its arguments by name, the shared
    ones it takes, `progress`, `shard` (rank, ranks) and `models` (every checkpoint given, by name, the first first);
  * `figure(table)`, `summary_table(table)` (what the command line prints), `csv(table)` (the rows `<name>.csv`
    holds) and `outputs`, the further files it writes, {file name: table -> its rows};
  * `requires(model)`: what to warn of before it runs on this model (None: nothing);
  * `page`: how the Probes page lays it out beside its arguments' widgets (`PageParts`).
A probe module registers its probe when imported (`register_probe`), and `registered_probes()` imports every module
of this package first: a new probe is a new module, and no list names it.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

    from memviz.protocol import MemoryModel


@dataclass(frozen=True)
class Widget:
    """How the Probes page asks for an argument: `kind` "multiselect" (several of `options`, run sorted),
    "selectbox" (one of them) or "number" (a whole number within `bounds`, by `step`), kept under `key`.
    `noun`: a multiselect the page will not run empty, named in its refusal ("length"); `tokens`: its values are
    prompt lengths, which the page reckons a run's cost from."""

    kind: Literal["multiselect", "selectbox", "number"]
    key: str
    label: str
    options: tuple[Any, ...] = ()
    default: Any = None
    help: str | None = None
    bounds: tuple[int, int] = (0, 0)
    step: int = 1
    noun: str = ""
    tokens: bool = False


@dataclass(frozen=True)
class Arg:
    """One argument of a probe: `name` is its key in the run's arguments and, with dashes, its flag (--data-path);
    `type`, `default`, `nargs`, `choices`, `required` and `help` are argparse's; `widget` is how the Probes page asks
    for it (None: the page runs it at its default)."""

    name: str
    type: Callable[[str], Any] = str
    default: Any = None
    nargs: Literal["+", "*"] | None = None
    choices: tuple[Any, ...] | None = None
    help: str | None = None
    required: bool = False
    widget: Widget | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        default = list(self.default) if self.nargs and isinstance(self.default, tuple) else self.default
        parser.add_argument(
            self.flag,
            dest=self.name,
            type=self.type,
            default=default,
            nargs=self.nargs,
            choices=self.choices,
            required=self.required,
            help=self.help,
        )


class Unsampled(NamedTuple):
    """Why a probe that draws nothing takes neither --n nor --seed, and what chooses its input instead: said when
    one is given ("lm reads ... : --n does not apply (choose ...)")."""

    why: str
    instead: str


def no_check(values: Mapping[str, Any]) -> str | None:
    return None


def as_given(values: dict[str, Any]) -> dict[str, Any]:
    return values


@dataclass(frozen=True)
class PageParts:
    """How the Probes page lays a probe out beside its arguments' widgets: `label` in the probe picker (the name
    if empty), `caption` above its widgets, the widgets of the shared `n` and `seed`, the Run button's `run_key`,
    `beside_key` (the multiselect of the checkpoints drawn beside the model, for a probe over several), `counts`
    (what its progress counts), `check` (a refusal of the page's values before a Run, or None), `prepare` (the
    page's values as the runner takes them), `summary` (show the summary table rather than the rows) and
    `download` (the file offered: one of the probe's `outputs`; empty: the rows as `<name>.csv`)."""

    label: str = ""
    caption: str = ""
    n: Widget = Widget("number", "n", "Samples per cell", default=5, bounds=(1, 200))
    seed: Widget = Widget("number", "probe_seed", "Seed", default=0, bounds=(0, 10_000))
    run_key: str = "run_probe"
    beside_key: str = ""
    counts: str = "samples"
    check: Callable[[Mapping[str, Any]], str | None] = no_check
    prepare: Callable[[dict[str, Any]], dict[str, Any]] = as_given
    summary: bool = False
    download: str = ""


def as_is(df: pd.DataFrame) -> pd.DataFrame:
    return df


def nothing_required(model: MemoryModel) -> str | None:
    return None


@dataclass(frozen=True)
class Probe:
    """Everything the command line, the page and notebooks know of one probe (module docstring). `order` places
    it in their lists (lower first, then by registration)."""

    name: str
    summary: str
    run: Callable[[MemoryModel, argparse.Namespace], pd.DataFrame]
    figure: Callable[[pd.DataFrame], go.Figure]
    summary_table: Callable[[pd.DataFrame], pd.DataFrame | pd.Series]
    args: tuple[Arg, ...] = ()
    unsampled: Unsampled | None = None
    workers: bool = False
    several: bool = False
    csv: Callable[[pd.DataFrame], pd.DataFrame] = as_is
    outputs: Mapping[str, Callable[[pd.DataFrame], pd.DataFrame]] = field(default_factory=dict)
    requires: Callable[[MemoryModel], str | None] = nothing_required
    page: PageParts = PageParts()
    order: int = 100

    @property
    def sampled(self) -> bool:
        """Whether it draws samples (and takes --n and --seed)."""
        return self.unsampled is None

    @property
    def files(self) -> list[str]:
        """The files a run writes: `<name>.csv`, the further `outputs`, and the figure `<name>.html` last."""
        return [f"{self.name}.csv", *self.outputs, f"{self.name}.html"]

    def arguments(
        self,
        model: MemoryModel,
        models: Mapping[str, MemoryModel] | None = None,
        progress: Any = False,
        shard: tuple[int, int] = (0, 1),
        **values: Any,
    ) -> argparse.Namespace:
        """The runner's arguments: `values` by name, each one not given at its default (n 10, seed 0, one worker);
        ValueError naming any that the probe does not take."""
        defaults: dict[str, Any] = {arg.name: arg.default for arg in self.args}
        if self.sampled:
            defaults.update(n=10, seed=0)
        if self.workers:
            defaults["workers"] = 1
        unknown = sorted(set(values) - set(defaults))
        if unknown:
            raise ValueError(f"probe {self.name!r} takes no {', '.join(unknown)}; it takes {', '.join(defaults)}")
        return argparse.Namespace(
            **{**defaults, **values}, progress=progress, shard=shard, models=models or {"model": model}
        )

    def run_with(self, model: MemoryModel, **values: Any) -> pd.DataFrame:
        """The probe's table for `model`, with `values` as in `arguments` (a notebook's call)."""
        return self.run(model, self.arguments(model, **values))


def keywords(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The named arguments of a run, as keywords of the module's own `run` (which names them alike)."""
    return {name: getattr(args, name) for name in names}


PROBES: dict[str, Probe] = {}
_discovered = False


def register_probe(probe: Probe) -> Probe:
    """Register `probe` under its name; ValueError if one is registered under it already."""
    if probe.name in PROBES:
        raise ValueError(f"probe {probe.name!r} registered twice")
    PROBES[probe.name] = probe
    return probe


def unregister_probe(name: str) -> None:
    """Forget a probe (a test's or a notebook's own, defined again)."""
    PROBES.pop(name, None)


def discover() -> None:
    """Import every module of this package (once), so each registers its probe; private ones (`_*`, `__main__`) and
    tests are left out."""
    global _discovered
    if _discovered:
        return
    import memviz_probes

    for found in sorted(pkgutil.iter_modules(memviz_probes.__path__), key=lambda module: module.name):
        if not found.name.startswith(("_", "test_")):
            importlib.import_module(f"memviz_probes.{found.name}")
    _discovered = True


def registered_probes() -> list[Probe]:
    """Every probe, in their `order`, then in registration order."""
    discover()
    return sorted(PROBES.values(), key=lambda probe: probe.order)


def get_probe(name: str) -> Probe:
    """The registered probe `name`; ValueError naming the known ones otherwise."""
    discover()
    if name not in PROBES:
        raise ValueError(f"unknown probe {name!r}; known probes are {', '.join(p.name for p in registered_probes())}")
    return PROBES[name]
