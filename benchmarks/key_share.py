"""Where a sample reads the pass key from, layer by layer: `python benchmarks/key_share.py NAME
--lengths 4096 16384 [--n 3] [--haystack grass] [--threads 2]`.

For each pass-key prompt (probe seed 11 by default, depths 0.1 / 0.5 / 0.9), at the position that
predicts the key's first digit, per layer:
  * share: the needle's part of the memory read there (`memory_readout`), projected on the read,
    over the read's squared norm (`Readout.shares`; a mean over heads where a layer has several).
    The parts of every token and the initial term sum to the read, so the shares of all spans add
    up to 1; 0 where the read ignores the needle.
  * held: what is left there of the needle's write in that layer's memory (`needle_hold`), over its
    largest, as the Trace page draws it.
One line per prompt with the greedy answer's correctness, then the means by length, split by right
and wrong answers. A family without a readout is refused.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memviz.registry import holds_needle, reads_out  # noqa: E402


def read_shares(model, ids: list[int], position: int, span: tuple[int, int]) -> list[float]:
    """Per layer, the share of the memory read at `position` that the tokens of `span` wrote
    (`Readout.shares`, summed over the span, averaged over heads)."""
    readout = model.memory_readout(ids, position)
    return [float(readout.shares(layer)[span[0] : span[1]].sum(0).mean()) for layer in readout.parts]


def held_at(model, ids: list[int], position: int, span: tuple[int, int]) -> list[float]:
    """Per layer, `needle_hold` at `position`: what is left of the span's write, over its largest
    (none for a family that does not follow a write)."""
    holder = holds_needle(model)
    hold = holder.needle_hold(ids, span) if holder is not None else None
    return [float(values[position]) for values in hold.values()] if hold else []


def prompt_parser(description: str, depths: list[float], n: int) -> argparse.ArgumentParser:
    """The arguments of a script that runs a sample over seeded pass-key prompts (this one, null_write.py)."""
    from memviz.threads import thread_count

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("checkpoint")
    parser.add_argument("--lengths", type=int, nargs="+", required=True)
    parser.add_argument("--depths", type=float, nargs="+", default=depths)
    parser.add_argument("--n", type=int, default=n, help="prompts per length and depth")
    parser.add_argument("--haystack", help="the pass key's filler: procedural (default), grass, shakespeare_train")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--threads", type=thread_count, default=1)
    return parser


def load_checked(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The sample of `args.checkpoint`, once --n is checked (the threads set)."""
    import memviz

    if args.n < 1:
        parser.error(f"--n must be at least 1, got {args.n}")
    torch.set_num_threads(args.threads)
    return memviz.load(args.checkpoint)


def prompts(model, args: argparse.Namespace):
    """(length, depth, index, sample, token ids) for every prompt the arguments ask for."""
    from memviz_probes.passkey import seeded_sample

    for length in args.lengths:
        for depth in args.depths:
            for i in range(args.n):
                sample = seeded_sample(model.tokenizer, length, depth, args.seed, i, args.haystack)
                yield length, depth, i, sample, model.tokenizer.encode(sample.prompt)


def main(argv: list[str] | None = None) -> int:
    from memviz_probes.passkey import score

    parser = prompt_parser(__doc__.split("\n\n")[0], depths=[0.1, 0.5, 0.9], n=3)
    args = parser.parse_args(argv)
    model = load_checked(parser, args)
    reader = reads_out(model)
    if reader is None or reader.memory_readout([0] * 8, 7) is None:
        parser.error(f"{args.checkpoint}: its family ({model.family}) gives no memory readout with these options")
    rows = []
    print("length  depth  i  right  share per layer | held per layer")
    for length, depth, i, sample, ids in prompts(model, args):
        span = tuple(sample.evidence[0])
        position = len(ids) - 1  # the prompt's last token predicts the key's first digit
        right = score(model.generate(sample.prompt, max_new_tokens=8), sample)
        share, held = read_shares(model, ids, position, span), held_at(model, ids, position, span)
        rows.append((length, right, share, held))
        print(
            f"{length:6d}  {depth:5.2f}  {i}  {'yes' if right else 'no ':5s}  "
            f"{' '.join(f'{s:+.2f}' for s in share)} | {' '.join(f'{h:.2f}' for h in held)}",
            flush=True,
        )
    print("\nmeans: length, answers, n, share per layer | held per layer")
    for length in args.lengths:
        for right in (True, False):
            group = [(s, h) for L, r, s, h in rows if L == length and r == right]
            if group:
                share = [statistics.fmean(col) for col in zip(*(s for s, _ in group))]
                held = [statistics.fmean(col) for col in zip(*(h for _, h in group))]
                print(
                    f"{length:6d}  {'right' if right else 'wrong'}  {len(group):2d}  "
                    f"{' '.join(f'{s:+.2f}' for s in share)} | {' '.join(f'{h:.2f}' for h in held)}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
