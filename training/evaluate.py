"""Score a checkpoint on the probes: `python -m training.evaluate CHECKPOINT [--n N] [--seed S] [--write-card]`.

Without options it runs the probe grid recorded in the checkpoint's card (the training
config's `eval` section) with `final_n` samples per cell on the card's probe seed and prints
the scores; `--n` and `--seed` score more or fresh samples on the same grid (two checkpoints
whose n = 20 scores differ by a story or two are told apart at n = 100 on two seeds); with
`--write-card` it also stores them in card.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

import memviz
from memviz.checkpoint import CARD_FILE, resolve
from memviz.files import atomic_write_text
from memviz.protocol import MemoryModel
from memviz.running import NonFiniteError
from memviz.tokenizer import Tokenizer
from memviz_probes import babilong, facts, lm, passkey, texts
from training.config import EvalConfig


def card_train_config(card: dict) -> dict:
    """A card's `train_config` (empty where it has none); ValueError naming the field where it, its `data` or
    its `eval` is not a mapping."""
    train_config = card.get("train_config", {})
    if not isinstance(train_config, dict):
        raise ValueError(
            f"card.json: train_config must be a mapping (the run's training config), got {train_config!r:.80}"
        )
    for part in ("data", "eval"):
        if not isinstance(train_config.get(part, {}), dict):
            raise ValueError(f"card.json: train_config.{part} must be a mapping, got {train_config[part]!r:.80}")
    return train_config


def card_eval_grid(card: dict) -> EvalConfig:
    """The probe grid a card's training config names, validated as a training config's `eval` is."""
    grid = card_train_config(card).get("eval", {})
    known = {f.name for f in dataclasses.fields(EvalConfig)}
    try:
        config = EvalConfig(**{k: v for k, v in grid.items() if k in known})
        config.check_grid()
        return config
    except ValueError as exc:
        raise ValueError(f"card.json: train_config.{exc}") from exc


def check_grid_fits(tokenizer: Tokenizer, grid: EvalConfig, haystack: str = "procedural") -> None:
    """Make each probe's shortest prompt of the grid once, so a length too short for its task (in this tokenizer's
    tokens) is refused before training rather than found at the first evaluation or the export."""
    from memviz_probes.babilong.samples import seeded_sample as babilong_sample

    try:
        if grid.passkey_lengths:
            passkey.seeded_sample(tokenizer, min(grid.passkey_lengths), 0.5, grid.seed, 0)
    except ValueError as exc:
        raise ValueError(f"eval.passkey_lengths: {exc}") from exc
    try:
        for task in grid.babilong_tasks if grid.babilong_lengths else ():
            babilong_sample(tokenizer, task, min(grid.babilong_lengths), grid.seed, 0, haystack)
    except ValueError as exc:
        raise ValueError(f"eval.babilong_tasks and babilong_lengths: {exc}") from exc


def trained_haystack(card: dict) -> str:
    """The background a checkpoint's BABILong stories were trained in (its card's data.haystack)."""
    return card_train_config(card).get("data", {}).get("haystack", "procedural")


def probe_scores(
    model: MemoryModel,
    passkey_lengths: Sequence[int] = (),
    passkey_depths: Sequence[float] = (0.1, 0.5, 0.9),
    babilong_tasks: Sequence[str] = (),
    babilong_lengths: Sequence[int] = (),
    n_facts: int = 0,
    n: int = 10,
    seed: int = 0,
    progress: bool = False,
    haystack: str = "procedural",
    passkey_haystacks: Sequence[str] = (),
    language_modelling: bool = False,
) -> dict[str, Any]:
    """Accuracies keyed by probe: passkey[length] (and passkey_<background>[length] for each of
    `passkey_haystacks`), babilong[task][length], facts, and with `language_modelling` lm[corpus], bits per
    byte on the held-out documents. BABILong's stories lie in `haystack`, the background the model was
    trained on (the data config's)."""
    scores: dict[str, Any] = {}
    for background in (None, *passkey_haystacks) if passkey_lengths else ():
        df = passkey.run(model, passkey_lengths, passkey_depths, n=n, seed=seed, haystack=background, progress=progress)
        scores["passkey" if background is None else f"passkey_{background}"] = {
            str(k): round(float(v), 4) for k, v in df.groupby("length")["correct"].mean().items()
        }
    if babilong_tasks and babilong_lengths:
        df = babilong.run(model, babilong_tasks, babilong_lengths, n=n, seed=seed, haystack=haystack, progress=progress)
        scores["babilong"] = {
            task: {str(k): round(float(v), 4) for k, v in group.groupby("length")["correct"].mean().items()}
            for task, group in df.groupby("task")
        }
    if n_facts:
        df = facts.run(model, n=n_facts, seed=seed, progress=progress)
        scores["facts"] = round(float(df["correct"].mean()), 4)
    if language_modelling:
        try:
            table = lm.summary(lm.run(model, corpus=None, keep_losses=False))
            scores["lm"] = {corpus: round(float(v), 4) for corpus, v in table["bits_per_byte"].items()}
        except NonFiniteError as exc:  # a diverged memory is a result, not a reason to lose the run
            scores["lm"] = {"diverged": str(exc)}
        scores["lm_held_out"] = {corpus: list(names) for corpus, names in texts.HELD_OUT.items()}
    scores["n_per_cell"] = n
    return scores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--n", type=int, help="samples per cell (default: the card's final_n)")
    parser.add_argument("--seed", type=int, help="probe seed (default: the card's); another seed draws fresh samples")
    parser.add_argument("--write-card", action="store_true", help="store the scores (and their seed) in the card")
    args = parser.parse_args(argv)
    if args.n is not None and args.n < 1:
        parser.error(f"--n must be at least 1, got {args.n}")
    try:
        model = memviz.load(args.checkpoint)
    except memviz.CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        grid, haystack = card_eval_grid(model.card), trained_haystack(model.card)
    except ValueError as exc:
        print(f"error: {resolve(args.checkpoint)}/{exc}", file=sys.stderr)
        return 2
    n = args.n or grid.final_n
    seed = grid.seed if args.seed is None else args.seed
    try:
        scores = probe_scores(
            model,
            passkey_lengths=grid.passkey_lengths,
            passkey_depths=grid.passkey_depths,
            babilong_tasks=grid.babilong_tasks,
            babilong_lengths=grid.babilong_lengths,
            n_facts=grid.facts,
            n=n,
            seed=seed,
            progress=True,
            haystack=haystack,
            passkey_haystacks=grid.passkey_haystacks,
            language_modelling=grid.lm,
        )
    except ValueError as exc:  # a grid past the probes' caps (--n), refused before it runs
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(scores, indent=2))
    if args.write_card:
        path = resolve(args.checkpoint) / CARD_FILE
        card = json.loads(path.read_text()) if path.exists() else {}
        card["probe_scores"], card["probe_seed"] = scores, seed
        atomic_write_text(path, json.dumps(card, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
