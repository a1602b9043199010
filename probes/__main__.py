"""Run a probe from the command line and write its results as CSV and an HTML figure.

    python -m memviz_probes passkey  CHECKPOINT --lengths 512 2048 --depths 0 0.5 1 --n 10 --out results/
    python -m memviz_probes babilong CHECKPOINT --tasks qa1 qa2 --lengths 1000 2000 [--data-path DIR]
    python -m memviz_probes facts    CHECKPOINT --n 200
    python -m memviz_probes retention CHECKPOINT [CHECKPOINT ...] --distances 64 1024 16384 --n 30
    python -m memviz_probes ruler CHECKPOINT --tasks niah_single_1 niah_single_2 --lengths 2048 4096 [--depths 0 1]
    python -m memviz_probes lm CHECKPOINT [CHECKPOINT ...] [--corpus shakespeare] [--split heldout] [--max-tokens N]
    python -m memviz_probes reread CHECKPOINT [CHECKPOINT ...] --distances 64 1024 4096 16384 --n 8
    python -m memviz_probes mqar CHECKPOINT [CHECKPOINT ...] --lengths 512 2048 --pairs 4 8 16 32 --n 20

The probes and their arguments are the registry's (`memviz_probes.registry`): each takes its own flags and the
shared ones it declares. `--workers N` (passkey, ruler) splits the grid over N processes and gathers the same table;
so does `torchrun --nproc_per_node N -m memviz_probes ...` (ranks on one machine or, by torchrun's rendezvous, on
several; rank 0 writes the files).

CHECKPOINT is a checkpoint folder or the name of a sample checkpoint. Each run writes
`<out>/<probe>.csv` (one row per sample) and `<out>/<probe>.html` (the heatmap, the bar chart
for facts, the accuracy-against-distance curve for retention, one line per checkpoint) and
prints the accuracy table. `lm` writes `lm.csv` (bits per byte per document and model),
`lm_positions.csv` and `lm.html` (loss against token position, one line per checkpoint) and prints
bits per byte per corpus. A probe's files already in `<out>` are replaced only with `--replace`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pandas as pd

from memviz.files import atomic_write_text, check_writable_folder
from memviz.threads import check_threads
from memviz_probes.common import merge_shards
from memviz_probes.registry import Probe, get_probe, registered_probes

#: flags a probe that draws nothing refuses, named, so that they are not read as --no-progress
SAMPLING_FLAGS = ("--n", "--samples", "--seed")


def parser() -> argparse.ArgumentParser:
    """One subcommand per registered probe: its own arguments and the shared ones it takes."""
    p = argparse.ArgumentParser(prog="python -m memviz_probes", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="probe", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("checkpoint", help="checkpoint folder or sample checkpoint name")
    common.add_argument("--out", default="probe_results", help="folder for the CSV and HTML files")
    common.add_argument(
        "--replace", action="store_true", help="replace this probe's files already in --out (refused without it)"
    )
    common.add_argument("--no-progress", action="store_true")
    common.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: torch's, one per core; with other jobs on the machine fewer are often faster)",
    )
    sampled = argparse.ArgumentParser(add_help=False, parents=[common])
    sampled.add_argument(
        "--n",
        "--samples",
        dest="n",
        type=int,
        default=10,
        help="samples per cell (facts: facts asked); under torchrun spell it --samples",
    )
    sampled.add_argument("--seed", type=int, default=0)
    for probe in registered_probes():
        sp = sub.add_parser(probe.name, parents=[sampled if probe.sampled else common], help=probe.summary)
        if probe.several:
            sp.add_argument(
                "more", nargs="*", metavar="CHECKPOINT", help="more checkpoints (a control, say), one line each"
            )
        for arg in probe.args:
            arg.add_to(sp)
        if probe.workers:
            sp.add_argument("--workers", type=int, default=1, help="processes to split the grid over")
        if not probe.sampled:
            for flag in SAMPLING_FLAGS:
                sp.add_argument(flag, dest=f"unused_{flag.strip('-')}", help=argparse.SUPPRESS)
    return p


def torchrun_shard() -> tuple[int, int]:
    """(rank, world size) under torchrun; (0, 1) otherwise. ValueError naming RANK or WORLD_SIZE if they are
    not whole numbers with 0 <= RANK < WORLD_SIZE."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    if not (rank.isdigit() and world.isdigit() and int(rank) < int(world)):
        raise ValueError(
            f"RANK and WORLD_SIZE (torchrun's) must be whole numbers, 0 <= RANK < WORLD_SIZE; got "
            f"RANK={rank!r} and WORLD_SIZE={world!r}"
        )
    return int(rank), int(world)


def gathered(df: pd.DataFrame, world: int) -> pd.DataFrame | None:
    """Every rank's shard of the grid on rank 0, in single-process order (None on the others)."""
    if world == 1:
        return df
    import torch.distributed as dist

    parts: list[pd.DataFrame | None] = [None] * world
    dist.all_gather_object(parts, df)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return merge_shards([part for part in parts if part is not None]) if rank == 0 else None


def refuse_sampling_flags(probe: Probe, args: argparse.Namespace) -> None:
    """ValueError naming the sampling flags given to a probe that draws nothing (they would do nothing)."""
    given = [f"--{key[7:]}" for key, value in vars(args).items() if key.startswith("unused_") and value is not None]
    if probe.unsampled is not None and given:
        raise ValueError(
            f"{probe.name} {probe.unsampled.why}: {' and '.join(given)} {'does' if len(given) == 1 else 'do'} not "
            f"apply ({probe.unsampled.instead})"
        )


def check_out(out: Path, written: list[Path], replace: bool) -> None:
    """ValueError before the run where --out cannot take the results: they are never lost to, nor written
    through, what is there."""
    check_writable_folder(out, "--out")
    for path in written:
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise ValueError(f"--out {out}: {path} is there and is not a plain file (a link or a folder)")
        if path.exists() and not replace:
            raise ValueError(f"--out {out}: {path} holds an earlier run's results; pass --replace to replace them")


def a_list(names: list[str]) -> str:
    return " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    probe = get_probe(args.probe)
    import memviz

    try:
        rank, world = torchrun_shard()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if world > 1:
        if not probe.workers or args.workers > 1:
            grids = a_list([p.name for p in registered_probes() if p.workers])
            print(f"error: torchrun splits the {grids} grids, without --workers", file=sys.stderr)
            return 2
        import torch.distributed as dist

        dist.init_process_group("gloo")
    progress = not args.no_progress and rank == 0
    if args.threads is not None:
        try:
            check_threads(args.threads, "--threads")
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.threads)
    out = Path(args.out)
    made = not out.exists()
    written = [out / name for name in probe.files]
    named = [args.checkpoint, *(args.more if probe.several else ())]
    try:
        refuse_sampling_flags(probe, args)
        if not args.out.strip():  # Path("") is the working folder: an empty flag is a slip, not a choice
            raise ValueError("--out: an empty path; give the folder for the results")
        check_out(out, written, args.replace)
        twice = sorted({name for name in named if named.count(name) > 1})
        if twice:  # one line per checkpoint: a name given twice would merge into one
            raise ValueError(f"checkpoint {', '.join(map(repr, twice))} is given more than once")
        try:  # before the grid: a folder that cannot be made loses no results
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--out {out} cannot be made: {exc.strerror or exc}") from exc
        model = memviz.load(args.checkpoint)
        warning = probe.requires(model)
        if warning:
            print(f"warning: {args.checkpoint}: {warning}", file=sys.stderr)
        args.models = {args.checkpoint: model, **{path: memviz.load(path) for path in named[1:]}}
        args.progress, args.shard = progress, (rank, world)
        df = gathered(probe.run(model, args), world)
        if df is None:
            return 0
        tables = [probe.csv(df), *(rows(df) for rows in probe.outputs.values())]
        fig, summary = probe.figure(df), probe.summary_table(df)
    except (memviz.CheckpointError, ValueError, OSError, KeyboardInterrupt) as exc:
        if made and out.is_dir() and not any(out.iterdir()):  # a refused or stopped run leaves no folder behind
            out.rmdir()
        if isinstance(exc, KeyboardInterrupt):
            print("interrupted: no results written; what --out held before is as it was", file=sys.stderr)
            return 130
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path, table in zip(written, tables):
        atomic_write_text(path, table.to_csv(index=False))
    atomic_write_text(written[-1], fig.to_html(include_plotlyjs=True))
    scored = "correct" in df
    print(summary.to_string(float_format=(lambda v: f"{v:.0%}") if scored else (lambda v: f"{v:.3f}")))
    accuracy = f"accuracy {df['correct'].mean():.1%} over {len(df)} samples; " if scored else ""
    files = f"{out / probe.name}.csv and .html" if not probe.outputs else ", ".join(map(str, written))
    print(f"{accuracy}wrote {files}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
