"""The long grid: `python benchmarks/long_grid.py NAME [NAME ...] [--lengths ...] [--n N] [--babilong qa1] [--record]`.

Pass key at long lengths (default 1k, 4k, 16k and 64k tokens) with the needle at depths 0.1, 0.5
and 0.9, `n` samples per depth (so 3n a cell) on a probe seed apart from the cards' (default 11),
for each named checkpoint. With `--babilong TASK` the grid is that BABILong-style task instead
(default lengths 4k, 8k and 16k, `n` samples a cell, facts spread over the input), its stories in
the background each checkpoint was trained on (its card's data.haystack: procedural for the
shipped qa1 samples) unless `--haystack` names another; for the pass key `--haystack` names its filler
(`grass`: the papers' prompt; recorded under the lengths' key with `:grass`). `--set KEY=VALUE` loads with an option
that holds no weights (e.g.
`--set bank_size=1048576 --set search=hnsw` for LongMem), applied to the checkpoints whose family
knows it; a key that none of them knows is refused. With `--record` the scores, the command and the
wall time go into each sample's card under `long_grid` (one entry per length set). Prints one row per checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_setting(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def option_names(family: str) -> set[str]:
    """A family's memory options: the fields of its model's `Options` (every MemoryLM has one)."""
    from memviz.registry import get_family

    return {f.name for f in dataclasses.fields(get_family(family).model.Options)}


def check_settings(parser: argparse.ArgumentParser, checkpoints, settings: list[tuple[str, object]]) -> None:
    """Exit with one line naming each `--set` key that no checkpoint's family knows: applied to
    none of them, it would change nothing, silently."""
    if not settings:
        return
    from memviz.checkpoint import read_config, resolve

    known: set[str] = set()
    for name in checkpoints:
        known |= option_names(read_config(resolve(name)).family)
    unknown = sorted({key for key, _ in settings} - known)
    if unknown:
        parser.error(f"--set {', '.join(unknown)}: no checkpoint's family has that option (theirs: {sorted(known)})")


def refused(parser: argparse.ArgumentParser, flag: str, check, *args):
    """`check(*args)`; its ValueError exits as one line naming `flag` (the probes' own checks, run up front)."""
    try:
        return check(*args)
    except ValueError as exc:
        parser.error(f"{flag}: {exc}")


def load_checkpoints(
    parser: argparse.ArgumentParser, names, settings: list[tuple[str, object]] = (), record: bool = False
) -> dict:
    """Every named checkpoint loaded (with its `--set` options) before any work starts: {name: model}. A name
    that is no checkpoint, weights that do not load, a bad option or (with `record`) a missing card.json exits
    as one line naming it, not as a traceback after the first checkpoints' runs."""
    from memviz.checkpoint import CARD_FILE, CheckpointError, check_folder

    for name in names:  # every folder's files first: quick, and a slip in the last name is found at once
        try:
            folder = check_folder(name)
        except CheckpointError as exc:
            parser.error(str(exc))
        if record and not (folder / CARD_FILE).is_file():
            parser.error(f"--record: {folder / CARD_FILE} is missing (the scores are stored in the checkpoint's card)")
    check_settings(parser, names, settings)
    models = {}
    for name in names:
        try:
            models[name] = load_with_settings(name, settings)[0]
        except CheckpointError as exc:
            parser.error(str(exc))
    return models


def load_with_settings(checkpoint, settings: list[tuple[str, object]]):
    """The checkpoint loaded with those `--set` options its family knows (options that hold no
    weights): (model, the overrides applied)."""
    import memviz

    model = memviz.load(checkpoint)
    known = option_names(model.family)
    overrides = {k: v for k, v in settings if k in known}
    return (memviz.load(checkpoint, **overrides) if overrides else model), overrides


def main(argv: list[str] | None = None) -> int:
    from memviz.checkpoint import CARD_FILE, atomic_write_text, resolve
    from memviz.threads import thread_count
    from memviz_probes import babilong, passkey
    from memviz_probes.common import check_depths, check_grid_size, check_lengths, check_n
    from memviz_probes.haystack import make_haystack
    from training.evaluate import trained_haystack

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--n", type=int, default=10, help="samples per depth and length (per length with --babilong)")
    parser.add_argument("--babilong", metavar="TASK", help="a BABILong-style task (qa1..qa5) in place of the pass key")
    parser.add_argument(
        "--haystack",
        help="BABILong's background: shakespeare, procedural or a text file "
        "(default: the one each checkpoint was trained on); the pass key's filler: "
        "procedural (default), grass (the papers'), shakespeare or a text file",
    )
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--threads", type=thread_count, default=1)
    parser.add_argument("--set", dest="settings", type=parse_setting, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--record", action="store_true", help="store the scores in each checkpoint's card.json")
    args = parser.parse_args(argv)
    args.lengths = args.lengths or ([4096, 8192, 16384] if args.babilong else [1024, 4096, 16384, 65536])
    # the whole grid is checked, and every checkpoint loaded, before the first grid runs
    if args.babilong:
        refused(parser, "--babilong", babilong.check_task, args.babilong)
    refused(parser, "--n", check_n, args.n)
    refused(parser, "--lengths", check_lengths, args.lengths)
    if not args.babilong:
        refused(parser, "--depths", check_depths, args.depths)
    cells = len(args.lengths) * (1 if args.babilong else len(args.depths))
    refused(parser, "--lengths, --depths and --n", check_grid_size, cells * args.n)
    if args.haystack:
        refused(parser, "--haystack", make_haystack, args.haystack, args.seed)
    models = load_checkpoints(parser, args.checkpoints, args.settings, record=args.record)

    def first_sample(model):
        """The grid's first prompt at its shortest length: ValueError where that cannot hold the fixed text."""
        shortest = min(args.lengths)
        if args.babilong:
            haystack = args.haystack or trained_haystack(model.card)
            return babilong.seeded_sample(model.tokenizer, args.babilong, shortest, args.seed, 0, haystack)
        return passkey.seeded_sample(model.tokenizer, shortest, args.depths[0], args.seed, 0, args.haystack)

    for name, model in models.items():
        refused(parser, f"--lengths {min(args.lengths)} on {name}", first_sample, model)
    torch.set_num_threads(args.threads)
    command = "python benchmarks/long_grid.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    for name, model in models.items():
        directory = resolve(name)
        overrides = {k: v for k, v in args.settings if k in option_names(model.family)}  # those applied
        started = time.perf_counter()
        if args.babilong:
            haystack = args.haystack or trained_haystack(model.card)
            df = babilong.run(
                model, [args.babilong], args.lengths, n=args.n, seed=args.seed, haystack=haystack, progress=False
            )
            probe, per_cell, key = args.babilong, args.n, f"{args.babilong}:" + "-".join(map(str, args.lengths))
            key += "" if haystack == "procedural" else f":{haystack}"
        else:
            df = passkey.run(
                model, args.lengths, args.depths, n=args.n, seed=args.seed, haystack=args.haystack, progress=False
            )
            probe, per_cell, key = "passkey", len(args.depths) * args.n, "-".join(map(str, args.lengths))
            key += f":{args.haystack}" if args.haystack else ""
        wall = time.perf_counter() - started
        scores = {str(k): round(float(v), 4) for k, v in df.groupby("length")["correct"].mean().items()}
        print(
            f"{name:24s} {model.family:10s} {probe:8s} "
            + (f"in {haystack if args.babilong else args.haystack} " if args.babilong or args.haystack else "")
            + "  ".join(f"{k}: {v:.0%}" for k, v in scores.items())
            + f"  ({per_cell} a cell, {wall:.0f} s)",
            flush=True,
        )
        if args.record:
            card_path = directory / CARD_FILE
            card = json.loads(card_path.read_text())
            entry = {
                probe: scores,
                "n_per_cell": per_cell,
                "seed": args.seed,
                "overrides": overrides,
                "command": command,
                "wall_time_s": round(wall, 1),
                "threads": args.threads,
            }
            if args.babilong or args.haystack:
                entry["haystack"] = haystack if args.babilong else args.haystack
            if not args.babilong:
                entry["by_length_and_depth"] = {
                    f"{k[0]}@{k[1]}": round(float(v), 4)
                    for k, v in df.groupby(["length", "depth"])["correct"].mean().items()
                }
                entry["depths"] = args.depths
            card.setdefault("long_grid", {})[key] = entry
            atomic_write_text(card_path, json.dumps(card, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
