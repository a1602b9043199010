"""A training step of each sample's recipe, this tree against a git revision, interleaved.

    python benchmarks/train_step.py titans infini_long memory_plus --against bf7cf35 [--threads 1] [--rounds 3]
    python benchmarks/train_step.py \\
        families/gated_deltanet/gated_deltanet_32k.train.json:families/gated_deltanet/sample_32k --against ...
    python benchmarks/train_step.py lm2_english --against HEAD --precision bfloat16

For each recipe (sample_checkpoints/NAME.train.json, or a recipe file and the sample it trained as
RECIPE:SAMPLE, e.g. a family's outside memviz) it times steps of the recipe's longest
curriculum stage (`--steps` consecutive batches from its middle, the ones the run itself draws
there, on the shipped sample's weights; their mean) in a fresh process for each tree, the
revision's and this one's in turn round after round (benchmarks/timing.py's rule), and gives the
median of the per-round ratios with their range. `--precision P` times this tree's steps under
`optim.precision` P (the revision's as its recipe says): against HEAD, what the precision alone gains.
The revision is checked out into a temporary git worktree and removed afterwards. Run it with
nothing else on the machine; --record appends the table to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: run in a child process whose working directory is the tree being timed
STEP_SCRIPT = """
import importlib.util, json, os, statistics, sys, tempfile, time
sys.path.insert(0, os.getcwd())
# the tree's own family folders: the installed memviz_families (an editable install) is one tree's
families = os.path.join(os.getcwd(), "families", "__init__.py")
if os.path.isfile(families):
    spec = importlib.util.spec_from_file_location(
        "memviz_families", families, submodule_search_locations=[os.path.dirname(families)]
    )
    sys.modules["memviz_families"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
import torch
torch.set_num_threads({threads})
from pathlib import Path
from memviz.checkpoint import load_weights, read_weights
from training import TrainConfig, Trainer
data = json.loads(open({recipe!r}).read())
data.update(out=tempfile.mkdtemp(prefix="train_step-"), threads={threads})
data["eval"] = {{**data.get("eval", {{}}), "every": 0}}
if {precision!r}:
    data["optim"]["precision"] = {precision!r}
# an earlier stage's export may be gone: its sample has the shapes
data["init_from"] = data.get("init_from") and {sample!r}
cfg = TrainConfig.from_dict(data)
trainer = Trainer(cfg, progress=False)
load_weights(trainer.model, read_weights(Path({weights!r})), Path({weights!r}))
trainer.step = {step} - 1
trainer.train_step()  # warm-up
seconds = []
for i in range({steps}):
    trainer.step = {step} + i  # consecutive batches of the stage: their lengths vary as the run's do
    started = time.perf_counter()
    trainer.train_step()
    seconds.append(time.perf_counter() - started)
print(json.dumps(statistics.fmean(seconds)))
"""


def last_stage_step(recipe: dict) -> int:
    """The middle step of the recipe's last (longest) length stage."""
    steps = recipe["optim"]["steps"]
    starts = [s for s, _ in recipe["data"].get("curriculum") or [[0, 0]] if s < steps]
    return (max(starts) + steps) // 2


def recipe_and_weights(name: str) -> tuple[Path, Path]:
    """A recipe's file and its sample's weights: NAME for sample_checkpoints/NAME.train.json and
    sample_checkpoints/NAME, or RECIPE:SAMPLE, two paths from the repository's root."""
    if ":" in name:
        recipe, sample = name.split(":", 1)
        return ROOT / recipe, ROOT / sample / "model.safetensors"
    return ROOT / "sample_checkpoints" / f"{name}.train.json", ROOT / "sample_checkpoints" / name / "model.safetensors"


def time_step(
    tree: Path, recipe: Path, weights: Path, step: int, threads: int, steps: int, precision: str | None = None
) -> float:
    script = STEP_SCRIPT.format(
        recipe=str(recipe),
        weights=str(weights),
        sample=str(weights.parent),
        step=step,
        threads=threads,
        steps=steps,
        precision=precision,
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=tree, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"timing {recipe.stem} in {tree} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    from memviz.threads import thread_count

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "recipes", nargs="+", help="NAME of sample_checkpoints/NAME.train.json, or RECIPE_FILE:SAMPLE_DIR"
    )
    parser.add_argument("--against", required=True, help="the git revision to compare with")
    parser.add_argument("--threads", type=thread_count, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="consecutive timed steps per process (after one warm-up)")
    parser.add_argument(
        "--precision", choices=["float32", "bfloat16"], help="this tree's steps under this optim.precision"
    )
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    for name, value in (("--rounds", args.rounds), ("--steps", args.steps)):
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    recipes = {name: recipe_and_weights(name) for name in args.recipes}
    for recipe, weights in recipes.values():
        if not recipe.is_file():
            parser.error(f"no recipe {recipe}")
        if not weights.is_file():
            parser.error(f"no sample {weights.parent} to take the weights from")
    revision = subprocess.run(["git", "rev-parse", "--short", args.against], cwd=ROOT, capture_output=True, text=True)
    if revision.returncode != 0:
        parser.error(f"--against: no git revision {args.against!r}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="train_step-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.against], cwd=ROOT, check=True)
        try:
            for recipe, weights in recipes.values():
                config = json.loads(recipe.read_text())
                step = last_stage_step(config)
                times: dict[str, list[float]] = {"base": [], "ours": []}
                for _ in range(args.rounds):
                    for label, tree, precision in (("base", base, None), ("ours", ROOT, args.precision)):
                        times[label].append(time_step(tree, recipe, weights, step, args.threads, args.steps, precision))
                ratios = sorted(b / o for b, o in zip(times["base"], times["ours"]))
                length = max(length for _, length in config["data"].get("curriculum") or [[0, 0]])
                row = (
                    f"| `{recipe.name.removesuffix('.train.json')}` | {config['optim']['batch_size']} x {length} | "
                    f"{statistics.median(times['base']):.3f} s | "
                    f"{statistics.median(times['ours']):.3f} s | {statistics.median(ratios):.2f}x "
                    f"({ratios[0]:.2f}-{ratios[-1]:.2f}) |"
                )
                print(row, flush=True)
                rows.append(row)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    if args.record:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a", encoding="utf-8") as fh:
            fh.write(
                f"\n## {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC · a training step against "
                f"{revision.stdout.strip()}{f', this tree in {args.precision}' if args.precision else ''}, "
                f"{args.threads} thread(s), {args.rounds} rounds\n\n`python benchmarks/train_step.py ... --against "
                f"{args.against}{f' --precision {args.precision}' if args.precision else ''}`: the mean time of "
                f"{args.steps} consecutive steps from the middle of each recipe's longest stage, "
                f"the median over rounds in each tree, and the median "
                "of the per-round ratios (above 1: this tree is faster).\n\n"
                "| recipe | batch x tokens | before | now | speedup |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
