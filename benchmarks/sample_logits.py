"""Every shipped sample's logits on one fixed input, saved or compared: the check that a refactor
changed no sample's numbers (`--save before.pt` on the old code, `--compare before.pt` on the new).

The input is 900 token ids drawn with a fixed seed, streamed in chunks of 320 (so segment
boundaries and the state carried between chunks are exercised), and the logits are kept whole.

    python benchmarks/sample_logits.py --save /tmp/before.pt
    python benchmarks/sample_logits.py --compare /tmp/before.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import memviz  # noqa: E402

TOKENS, CHUNK, SEED = 900, 320, 0


def sample_folders() -> dict[str, Path]:
    """Every sample folder that holds weights: sample_checkpoints/ and the families' own."""
    found = sorted(ROOT.glob("sample_checkpoints/*/model.safetensors")) + sorted(
        ROOT.glob("families/*/sample*/model.safetensors")
    )
    return {str(p.parent.relative_to(ROOT)): p.parent for p in found}


@torch.no_grad()
def logits_of(folder: Path) -> torch.Tensor:
    model = memviz.load(folder)
    ids = torch.randint(0, model.cfg.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(SEED))
    with model.evaluating():
        return torch.cat([logits for _, logits, _ in model.stream(ids, chunk_len=CHUNK)], dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", type=Path, help="write every sample's logits to this file")
    group.add_argument("--compare", type=Path, help="compare every sample's logits with this file's")
    args = parser.parse_args()
    torch.set_num_threads(1)
    now = {name: logits_of(folder) for name, folder in sample_folders().items()}
    if args.save:
        torch.save(now, args.save)
        print(f"{len(now)} samples' logits written to {args.save}")
        return
    before = torch.load(args.compare)
    common, differ = sorted(set(before) & set(now)), 0
    for name in sorted(set(before) | set(now)):
        if name not in common:
            print(f"{name}: only {'before' if name in before else 'now'}")
            continue
        same = torch.equal(before[name], now[name])
        gap = (before[name] - now[name]).abs().max().item()
        print(f"{name}: {'bit-identical' if same else f'differs, max |diff| {gap:.3g}'}")
        differ += not same
    only = len(set(before) ^ set(now))
    print(f"{len(common) - differ} of the {len(common)} samples in both runs bit-identical; {only} in one run only")
    sys.exit(1 if differ or only else 0)


if __name__ == "__main__":
    main()
