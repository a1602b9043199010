"""Run a probe from the command line and write its results as CSV and an HTML figure.

    python -m memviz_probes passkey  CHECKPOINT --lengths 512 2048 --depths 0 0.5 1 --n 10 --out results/
    python -m memviz_probes babilong CHECKPOINT --tasks qa1 qa2 --lengths 1000 2000 [--data-path DIR]
    python -m memviz_probes facts    CHECKPOINT --n 200
    python -m memviz_probes retention CHECKPOINT [CHECKPOINT ...] --distances 64 1024 16384 --n 30
    python -m memviz_probes ruler CHECKPOINT --tasks niah_single_1 niah_single_2 --lengths 2048 4096 [--depths 0 1]
    python -m memviz_probes lm CHECKPOINT [CHECKPOINT ...] [--corpus shakespeare] [--split heldout] [--max-tokens N]

`--workers N` (passkey, ruler) splits the grid over N processes and gathers the same table; so does
`torchrun --nproc_per_node N -m memviz_probes ...` (ranks on one machine or, by torchrun's rendezvous, on
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

from memviz.files import atomic_write_text, check_writable_folder
from memviz.threads import check_threads
from memviz_probes import babilong, facts, lm, passkey, retention, ruler, texts
from memviz_probes.common import merge_shards


def parser() -> argparse.ArgumentParser:
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
    # the probes that draw samples; lm reads whole documents, so it takes neither flag (none is ignored)
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
    pk = sub.add_parser("passkey", parents=[sampled], help="pass-key retrieval over lengths x depths")
    pk.add_argument("--lengths", type=int, nargs="+", required=True)
    pk.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    pk.add_argument(
        "--haystack",
        help="the filler: procedural (the default), grass (the papers' repeated sentences), shakespeare, or a "
        "plain-text file",
    )
    pk.add_argument("--workers", type=int, default=1, help="processes to split the grid over")
    bl = sub.add_parser("babilong", parents=[sampled], help="bAbI qa1-qa5 hidden in background text")
    bl.add_argument("--tasks", nargs="+", default=["qa1"])
    bl.add_argument("--lengths", type=int, nargs="+", required=True)
    bl.add_argument("--data-path", help="released BABILong files (JSON/JSONL/parquet) instead of generated samples")
    bl.add_argument("--haystack", help="the background: shakespeare (the default), procedural, or a plain-text file")
    sub.add_parser("facts", parents=[sampled], help="factual recall on the model's knowledge base")
    rt = sub.add_parser(
        "retention", parents=[sampled], help="pass key against the distance to the question, per checkpoint"
    )
    rt.add_argument("more", nargs="*", metavar="CHECKPOINT", help="more checkpoints, one line each")
    rt.add_argument("--distances", type=int, nargs="+", default=list(retention.DISTANCES[:5]))
    rt.add_argument("--haystack", help="the filler: procedural (the default), grass, shakespeare, or a plain-text file")
    ru = sub.add_parser("ruler", parents=[sampled], help="RULER's needle, tracing and aggregation tasks over lengths")
    ru.add_argument("--tasks", nargs="+", default=list(ruler.SINGLE_NEEDLE), help=f"of {', '.join(ruler.TASKS)}")
    ru.add_argument("--lengths", type=int, nargs="+", required=True)
    ru.add_argument(
        "--depths", type=float, nargs="+", help="fix the asked needle's depth (default: RULER's random depths)"
    )
    ru.add_argument(
        "--haystack", help="the essay background: shakespeare (the default), procedural, or a plain-text file"
    )
    ru.add_argument("--workers", type=int, default=1, help="processes to split the grid over")
    lmp = sub.add_parser("lm", parents=[common], help="bits per byte and loss against position on held-out text")
    lmp.add_argument("more", nargs="*", metavar="CHECKPOINT", help="more checkpoints (a control, say), one line each")
    lmp.add_argument(
        "--corpus",
        default="shakespeare",
        help=f"{', '.join(texts.CORPORA)}, 'all', or a UTF-8 file or folder of .txt files",
    )
    lmp.add_argument("--split", default="heldout", choices=texts.SPLITS)
    lmp.add_argument("--documents", nargs="+", help="only these documents of the split")
    lmp.add_argument("--max-tokens", type=int, help="cut each document to this many tokens")
    for flag in ("--n", "--samples", "--seed"):  # named, so that they are refused rather than read as --no-progress
        lmp.add_argument(flag, dest=f"unused_{flag.strip('-')}", help=argparse.SUPPRESS)
    return p


#: the files a probe writes under --out, its figure last; the others write <probe>.csv and <probe>.html
OUTPUTS = {"lm": ("lm.csv", "lm_positions.csv", "lm.html")}


def run_lm(args, model):
    """The lm probe's table, positions and figure; `lm.csv` without the per-token arrays."""
    import memviz

    models = {args.checkpoint: model, **{path: memviz.load(path) for path in args.more}}
    corpus = None if args.corpus == "all" else args.corpus
    df = lm.compare(models, corpus=corpus, split=args.split, documents=args.documents, max_tokens=args.max_tokens)
    positions = lm.by_position(df)
    return df, positions, lm.position_curve(positions, window=lm.local_span(model)), lm.summary(df)


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


def gathered(df, world: int):
    """Every rank's shard of the grid on rank 0, in single-process order (None on the others)."""
    if world == 1:
        return df
    import torch.distributed as dist

    parts = [None] * world
    dist.all_gather_object(parts, df)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return merge_shards(parts) if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import memviz

    try:
        rank, world = torchrun_shard()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if world > 1:
        if args.probe not in ("passkey", "ruler") or args.workers > 1:
            print("error: torchrun splits the passkey and ruler grids, without --workers", file=sys.stderr)
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
    written = [out / name for name in OUTPUTS.get(args.probe, (f"{args.probe}.csv", f"{args.probe}.html"))]
    try:
        if args.probe == "lm":
            given = [
                f"--{key[7:]}" for key, value in vars(args).items() if key.startswith("unused_") and value is not None
            ]
            if given:
                raise ValueError(
                    f"lm reads every token of whole documents and draws nothing: {' and '.join(given)} "
                    f"{'does' if len(given) == 1 else 'do'} not apply (choose what it reads with --documents and "
                    "--max-tokens)"
                )
        if not args.out.strip():  # Path("") is the working folder: an empty flag is a slip, not a choice
            raise ValueError("--out: an empty path; give the folder for the results")
        check_writable_folder(out, "--out")
        for path in written:  # before the grid: results are never lost to, nor written through, what is there
            if path.is_symlink() or (path.exists() and not path.is_file()):
                raise ValueError(f"--out {out}: {path} is there and is not a plain file (a link or a folder)")
            if path.exists() and not args.replace:
                raise ValueError(f"--out {out}: {path} holds an earlier run's results; pass --replace to replace them")
        if args.probe in ("retention", "lm"):  # one line per checkpoint: a name given twice would merge into one
            named = [args.checkpoint, *args.more]
            twice = sorted({name for name in named if named.count(name) > 1})
            if twice:
                raise ValueError(f"checkpoint {', '.join(map(repr, twice))} is given more than once")
        try:  # before the grid: a folder that cannot be made loses no results
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--out {out} cannot be made: {exc.strerror or exc}") from exc
        model = memviz.load(args.checkpoint)
        if args.probe == "facts" and "facts" not in model.card:
            print(
                f"warning: {args.checkpoint}: its card names no facts knowledge base (card.json 'facts'): the model "
                "was not trained on facts, so it is asked the default one (kb_seed 0, 1,000 people) and should score "
                "about nothing",
                file=sys.stderr,
            )
        if args.probe == "passkey":
            df = gathered(
                passkey.run(
                    model,
                    args.lengths,
                    args.depths,
                    n=args.n,
                    seed=args.seed,
                    haystack=args.haystack,
                    progress=progress,
                    workers=args.workers,
                    shard=(rank, world),
                ),
                world,
            )
            if df is None:
                return 0
            fig, table = passkey.heatmap(df), df.pivot_table(index="depth", columns="length", values="correct")
        elif args.probe == "babilong":
            df = babilong.run(
                model,
                args.tasks,
                args.lengths,
                n=args.n,
                seed=args.seed,
                data_path=args.data_path,
                haystack=args.haystack,
                progress=progress,
            )
            fig, table = babilong.heatmap(df), df.pivot_table(index="task", columns="length", values="correct")
        elif args.probe == "ruler":
            df = gathered(
                ruler.run(
                    model,
                    args.tasks,
                    args.lengths,
                    args.depths,
                    n=args.n,
                    seed=args.seed,
                    haystack=args.haystack,
                    progress=progress,
                    workers=args.workers,
                    shard=(rank, world),
                ),
                world,
            )
            if df is None:
                return 0
            rows = "depth" if len(args.tasks) == 1 and args.depths else "task"
            fig, table = ruler.heatmap(df), df.pivot_table(index=rows, columns="length", values="correct")
        elif args.probe == "retention":
            models = {args.checkpoint: model, **{path: memviz.load(path) for path in args.more}}
            df = retention.compare(
                models, args.distances, n=args.n, seed=args.seed, haystack=args.haystack, progress=progress
            )
            fig, table = (
                retention.curve(df),
                df.pivot_table(index="model", columns="distance", values="correct", sort=False),
            )
        elif args.probe == "lm":
            df, positions, fig, table = run_lm(args, model)
        else:
            df = facts.run(model, n=args.n, seed=args.seed, progress=progress)
            fig, table = facts.bar(df), df.groupby("attribute")["correct"].mean()
    except (memviz.CheckpointError, ValueError, OSError, KeyboardInterrupt) as exc:
        if made and out.is_dir() and not any(out.iterdir()):  # a refused or stopped run leaves no folder behind
            out.rmdir()
        if isinstance(exc, KeyboardInterrupt):
            print("interrupted: no results written; what --out held before is as it was", file=sys.stderr)
            return 130
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.probe == "lm":
        tables = [df.drop(columns="losses"), positions]
    else:
        tables = [df]
    for path, table_out in zip(written, tables):
        atomic_write_text(path, table_out.to_csv(index=False))
    atomic_write_text(written[-1], fig.to_html(include_plotlyjs=True))
    if args.probe == "lm":
        print(table.to_string(float_format=lambda v: f"{v:.3f}"))
        print(f"wrote {', '.join(str(p) for p in written)}")
        return 0
    print(table.to_string(float_format=lambda v: f"{v:.0%}"))
    print(f"accuracy {df['correct'].mean():.1%} over {len(df)} samples; wrote {out / args.probe}.csv and .html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
