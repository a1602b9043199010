"""Retention at one long distance, sample by sample: `python benchmarks/long_retention.py NAME
--distance 1048576 --n 30 [--set KEY=VALUE] [--log FILE] [--record]`.

The retention probe's samples (a pass key, then `distance` tokens of filler, then the question;
`probes/retention.py`) at one distance, each streamed and answered on its own, on probe seed 11
by default. Each result is appended to a JSONL log as soon as it is known, with the memory options
it ran with, and a rerun with the same log skips the samples already answered under the same
options: a run cut off goes on where it stopped. With `--record` the accuracy so far, the command
and the times go into the checkpoint's card under `long_grid`, key `retention:DISTANCE`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from long_grid import check_settings, load_with_settings, parse_setting  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from memviz.checkpoint import CARD_FILE, atomic_write_text, resolve
    from memviz.threads import thread_count
    from memviz_probes import retention
    from memviz_probes.passkey import score

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--distance", type=int, default=1 << 20)
    parser.add_argument("--n", type=int, default=30)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--threads", type=thread_count, default=1)
    parser.add_argument("--set", dest="settings", type=parse_setting, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--log", type=Path, help="JSONL of finished samples (default runs/retention/NAME-DISTANCE-SEED.jsonl)"
    )
    parser.add_argument("--record", action="store_true", help="store the accuracy in the checkpoint's card.json")
    args = parser.parse_args(argv)
    retention.check_distances([args.distance])
    check_settings(parser, [args.checkpoint], args.settings)
    torch.set_num_threads(args.threads)
    command = "python benchmarks/long_retention.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    directory = resolve(args.checkpoint)
    model, overrides = load_with_settings(directory, args.settings)
    log = args.log or ROOT / "runs" / "retention" / f"{directory.name}-{args.distance}-{args.seed}.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    memory = json.loads(json.dumps(model.cfg.memory))
    done = {}
    if log.is_file():
        for line in log.read_text().splitlines():
            row = json.loads(line)
            if row.get("memory") == memory:  # the same memory options, whether from the config or --set
                done[row["sample"]] = row
    for i in range(args.n):
        if i in done:
            continue
        sample = retention.seeded_sample(model.tokenizer, args.distance, args.seed, i)
        started = time.perf_counter()
        prediction = model.generate(sample.prompt, max_new_tokens=8)
        row = {
            "sample": i,
            "gap": sample.meta["distance"],
            "n_tokens": sample.n_tokens,
            "answer": sample.answer,
            "prediction": prediction,
            "correct": bool(score(prediction, sample)),
            "overrides": overrides,
            "memory": memory,
            "seconds": round(time.perf_counter() - started, 1),
            "threads": args.threads,
        }
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        done[i] = row
        print(f"sample {i}: {'right' if row['correct'] else 'wrong'} ({row['seconds']:.0f} s)", flush=True)
    rows = [done[i] for i in range(args.n) if i in done]
    accuracy = sum(r["correct"] for r in rows) / len(rows)
    print(f"{directory.name}: {accuracy:.0%} of {len(rows)} at {args.distance:,} tokens", flush=True)
    if args.record:
        card_path = directory / CARD_FILE
        card = json.loads(card_path.read_text())
        card.setdefault("long_grid", {})[f"retention:{args.distance}"] = {
            "retention": {str(args.distance): round(accuracy, 4)},
            "n_per_cell": len(rows),
            "seed": args.seed,
            "overrides": overrides,
            "memory": memory,
            "command": command,
            "median_s_per_sample": sorted(r["seconds"] for r in rows)[len(rows) // 2],
            "threads": sorted({r["threads"] for r in rows}),
        }
        atomic_write_text(card_path, json.dumps(card, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
