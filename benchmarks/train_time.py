"""How long a sample's recipe takes to train alone on this machine, estimated without the full run.

The cards' wall times were taken with other runs sharing the two cores. This script times a few
real training steps in each stage of a recipe's length curriculum (the batches the run itself
draws at those steps, on the shipped sample's weights so a late stage's long sequences are as
stable as they were in the run). A step's length is drawn per batch, over a wide range in some
stages, so the timed steps sit at spread quantiles of the stage's drawn lengths, a line
time = a + b x length is fitted to them, and the stage is that line summed over every step's length:

    python benchmarks/train_time.py titans_qa1 sliding_window_qa1 --threads 1 2

Run it with nothing else on the machine. It prints one row per recipe and thread count and
appends them to benchmarks/RESULTS.md with --record. Two stage recipes name their stages
(titans_stage1 titans_stage2 titans, lm2_qa1_stage1 lm2_qa1). `--chain SAMPLE ...` times every stage
a sample's card lists (`stages`, from the first run on fresh weights to the sample's own recipe) and
adds them up, each shared stage (the English backbone) timed once:

    python benchmarks/train_time.py --chain longmem_english lm2_english_16k --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # training is the repository's, not installed

from memviz.checkpoint import load_weights, read_weights  # noqa: E402
from training import TrainConfig, Trainer  # noqa: E402
from training.loop import cpu_model  # noqa: E402

SAMPLES = ROOT / "sample_checkpoints"


def stages(cfg: TrainConfig) -> list[tuple[int, int]]:
    """(first step, last step + 1) of each stage of the length and story-size curricula."""
    starts = sorted({0, *(s for s, _ in cfg.data.curriculum), *(s for s, _ in (cfg.data.max_facts or []))})
    starts = [s for s in starts if s < cfg.optim.steps]
    return list(zip(starts, [*starts[1:], cfg.optim.steps]))


def stage_weights(recipe: str, chain_sample: str | None = None) -> Path | None:
    """Weights to time on: the sample the recipe makes, or for a first stage the sample its
    last stage makes, or the sample of the chain the recipe is a stage of when it is the same
    family (same shapes)."""
    for name in (recipe, recipe.rsplit("_stage", 1)[0]):
        if (SAMPLES / name / "model.safetensors").is_file():
            return SAMPLES / name / "model.safetensors"
    if chain_sample is not None:
        family = json.loads((SAMPLES / f"{recipe}.train.json").read_text())["model"]["family"]
        sample = SAMPLES / chain_sample
        if json.loads((sample / "config.json").read_text())["family"] == family:
            return sample / "model.safetensors"
    return None


def chain_of(sample: str) -> list[str]:
    """The recipes a sample's card lists as its stages, in order (the sample's own last)."""
    path = SAMPLES / sample / "card.json"
    if not path.is_file():
        raise SystemExit(f"no sample card {path.relative_to(ROOT)}: --chain names samples in sample_checkpoints/")
    card = json.loads(path.read_text())
    names = [stage["name"] for stage in card.get("stages", [])]
    if not names:
        raise SystemExit(f"sample_checkpoints/{sample}/card.json lists no stages")
    return names if names[-1] == sample else [*names, sample]


def spread_picks(lengths: list[int], first: int, per_stage: int) -> list[int]:
    """The steps (numbered from `first`) in the middle of `per_stage` equal slices of the stage's
    steps sorted by their drawn `lengths`: quantiles of the lengths the stage trains on."""
    by_length = sorted(range(len(lengths)), key=lengths.__getitem__)
    return sorted({first + by_length[(2 * i + 1) * len(lengths) // (2 * per_stage)] for i in range(per_stage)})


def fitted_seconds(timed: list[tuple[int, float]], lengths: list[int]) -> float:
    """A stage's seconds: the line time = a + b x length through the (length, seconds) of its timed
    steps, summed over every step's length (their mean times the steps when one length was timed)."""
    drawn, seconds = zip(*timed)
    if len(set(drawn)) == 1:
        return statistics.mean(seconds) * len(lengths)
    slope, intercept = np.polyfit(drawn, seconds, 1)
    return float(intercept * len(lengths) + slope * sum(lengths))


def estimate(recipe: str, threads: int, per_stage: int, chain_sample: str | None = None) -> dict:
    data = json.loads((SAMPLES / f"{recipe}.train.json").read_text())
    data.update(out=tempfile.mkdtemp(prefix="train_time-"), threads=threads)
    data["eval"] = {**data.get("eval", {}), "every": 0}
    weights = stage_weights(recipe, chain_sample)
    if data.get("init_from") and not (ROOT / data["init_from"] / "model.safetensors").is_file():
        if weights is not None:
            data["init_from"] = str(weights.parent)  # an earlier stage not kept, or retired: its sample has the shapes
        else:
            del data["init_from"]  # nor a sample of its shapes: fresh weights time the same
    cfg = TrainConfig.from_dict(data)
    trainer = Trainer(cfg, progress=False)
    if weights is not None:
        load_weights(trainer.model, read_weights(weights), weights)
    trainer.train_step()  # warm-up: first-call allocations
    total, rows = 0.0, []
    for first, end in stages(cfg):
        lengths = [trainer.sampler.step_length(s, trainer.rank) for s in range(first, end)]
        timed = []
        for step in spread_picks(lengths, first, per_stage):
            trainer.step = step
            started = time.perf_counter()
            trainer.train_step()
            timed.append((lengths[step - first], time.perf_counter() - started))
        stage_seconds = fitted_seconds(timed, lengths)
        total += stage_seconds
        rows.append((first, end, min(lengths), max(lengths), round(stage_seconds / (end - first), 3)))
    return {
        "recipe": recipe,
        "threads": threads,
        "steps": cfg.optim.steps,
        "minutes": round(total / 60, 1),
        "stages": rows,
    }


def main() -> None:
    from memviz.threads import thread_count

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", nargs="*", help="names of sample_checkpoints/NAME.train.json")
    parser.add_argument("--chain", nargs="+", default=[], metavar="SAMPLE", help="time every stage a card lists")
    parser.add_argument("--threads", type=thread_count, nargs="+", default=[1])
    parser.add_argument("--per-stage", type=int, default=4, help="steps timed a curriculum stage, at spread lengths")
    parser.add_argument("--record", action="store_true", help="append the rows to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if not args.recipes and not args.chain:
        parser.error("name recipes or --chain samples")
    os.chdir(ROOT)  # recipes name their tokenizer and init_from relative to the repository
    chains = {sample: chain_of(sample) for sample in args.chain}
    # (recipe, the sample whose chain it is a stage of): that sample's weights stand in for a stage not kept
    jobs = [*((r, None) for r in args.recipes), *((r, s) for s, chain in chains.items() for r in chain)]
    for recipe, _ in jobs:
        if not (SAMPLES / f"{recipe}.train.json").is_file():
            parser.error(f"no recipe sample_checkpoints/{recipe}.train.json")
    lines, chain_lines = [], []
    for threads in args.threads:
        minutes: dict[str, float] = {}
        for recipe, sample in jobs:
            if recipe in minutes:
                continue
            result = estimate(recipe, threads, args.per_stage, sample)
            minutes[recipe] = result["minutes"]
            line = f"| `{recipe}` | {threads} | {result['steps']} | {result['minutes']} min |"
            print(line, json.dumps(result["stages"]), flush=True)
            lines.append(line)
        for sample, chain in chains.items():
            parts = " + ".join(f"{minutes[r]:.1f}" for r in chain)
            total = sum(minutes[r] for r in chain)
            line = f"| `{sample}` | {threads} | {' -> '.join(chain)} | {parts} = **{total:.0f} min** |"
            print(line, flush=True)
            chain_lines.append(line)
    if args.record:
        machine = f"{cpu_model()}, {torch.backends.cpu.get_cpu_capability()} kernels, torch {torch.__version__}"
        text = (
            f"\n## {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC · training time alone, estimated ({machine})\n\n"
            "`python benchmarks/train_time.py ...`: in each curriculum stage, a line fitted to the times of steps "
            "at spread lengths, summed over every step's drawn length.\n\n"
            "| recipe | threads | steps | estimate |\n|---|---|---|---|\n" + "\n".join(lines) + "\n"
        )
        if chain_lines:
            text += "\n| sample | threads | stages | minutes |\n|---|---|---|---|\n" + "\n".join(chain_lines) + "\n"
        with open(ROOT / "benchmarks" / "RESULTS.md", "a", encoding="utf-8") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
