"""Train a model on the probe tasks: `python -m training --config FILE [--resume] [--export DIR]`
(the options are in `training.loop`'s docstring)."""

from __future__ import annotations

import argparse
import shlex
import sys

import torch

from memviz.threads import check_threads
from training.config import PRECISIONS, TrainConfig, TrainingDiverged
from training.loop import Trainer, check_export_folder


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="training config (JSON)")
    start = parser.add_mutually_exclusive_group()  # continue the run there, or replace it: not both
    start.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    start.add_argument(
        "--overwrite", action="store_true", help="start afresh in a run folder that holds an earlier run"
    )
    parser.add_argument("--steps", type=positive_int, help="override optim.steps")
    parser.add_argument("--out", help="override the run folder")
    parser.add_argument(
        "--threads",
        type=positive_int,
        help="override the config's torch threads (another count "
        "rounds differently: the weights differ from a card's, the scores by a few points)",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="override optim.precision: bfloat16 runs the forward and loss under torch.autocast, faster on CPUs "
        "with AVX-512 BF16 or AMX and on GPUs (the weights differ from a float32 run's)",
    )
    parser.add_argument("--export", help="write the final model as a checkpoint folder here")
    parser.add_argument(
        "--replace-export", action="store_true", help="let --export replace a checkpoint folder already there"
    )
    parser.add_argument("--export-dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        cfg = TrainConfig.load(args.config)
        if args.steps is not None:
            cfg.optim.steps = args.steps
        if args.out:
            cfg.out = args.out
        if args.export is not None:
            if not args.export.strip():
                raise ValueError("--export: an empty path; give the folder to write the model to")
            check_export_folder(args.export, run_folder=cfg.out, replace_checkpoint=args.replace_export)
        if args.threads:
            cfg.threads = check_threads(args.threads, "--threads")
        if args.precision:
            cfg.optim.precision = args.precision
        # resuming is exact, so the card records the one-shot command that gives the same model
        given = [
            a
            for a in (argv if argv is not None else sys.argv[1:])
            if a not in ("--resume", "--overwrite", "--replace-export")
        ]
        command = "python -m training " + " ".join(shlex.quote(a) for a in given)
        trainer = Trainer(
            cfg, resume=args.resume, overwrite=args.overwrite, command=command, progress=not args.no_progress
        ).run()
    except TrainingDiverged as exc:  # the run failed; its checkpoints are kept
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:  # bad input (config, flags, files): one line, exit 2 as argparse does
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.export and trainer.rank == 0 and not trainer.stop.is_set():
        try:
            path = trainer.export(args.export, dtype=args.export_dtype)
        except (ValueError, OSError) as exc:  # the run is whole: say so beside why the export is not
            print(f"error: {exc}; the run's checkpoints under {trainer.out} are kept", file=sys.stderr)
            return 1
        print(f"exported {path}")
    if trainer.world > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
