"""What training refuses by, against what a step takes: for each shipped sample, the memory a training step over
one sequence is predicted to take (`training.memory.step_bytes`, what `training` checks before the first step)
beside the growth of the process's peak RSS over a real forward and backward, each in a fresh subprocess with one
thread.

    python benchmarks/step_memory.py --lengths 4096 16384 [NAME ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.sample_logits import sample_folders  # noqa: E402

STEP_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, {root!r})
import memviz
from training.memory import step_bytes
from benchmarks.released import status  # VmHWM: this process's own peak (ru_maxrss starts from the parent's)
torch.set_num_threads(1)
model = memviz.load({folder!r}).train()
predicted = step_bytes(model, 1, {length})
tokens = torch.randint(0, model.cfg.vocab_size, (1, {length}), generator=torch.Generator().manual_seed(0))
before = status("VmHWM")
model(tokens, return_type="loss").backward()
print(json.dumps({{"predicted": predicted, "grown": status("VmHWM") - before}}))
"""


def measure(folder: Path, length: int) -> dict:
    script = STEP_SCRIPT.format(root=str(ROOT), folder=str(folder), length=length)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="sample folders' names (default: every sample with weights)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    args = parser.parse_args()
    folders = {Path(key).name: folder for key, folder in sample_folders().items()}
    unknown = [name for name in args.names if name not in folders]
    if unknown:
        parser.error(f"no sample with weights named {', '.join(unknown)}; have {', '.join(sorted(folders))}")
    print("| sample | tokens | predicted, MiB | a step's peak growth, MiB | predicted / measured |")
    print("|---|---|---|---|---|")
    for name in args.names or sorted(folders):
        for length in args.lengths:
            row = measure(folders[name], length)
            predicted, grown = row["predicted"] / 2**20, row["grown"] / 2**20
            print(f"| `{name}` | {length:,} | {predicted:,.0f} | {grown:,.0f} | {predicted / grown:.2f} |", flush=True)


if __name__ == "__main__":
    main()
