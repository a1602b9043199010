"""The retention figure of docs/long_context.md: `python benchmarks/retention_curve.py NAME [NAME ...]
[--distances 64 256 ...] [--n 10] [--set KEY=VALUE] [--png docs/images/retention.png]`.

`memviz_probes.retention.compare` over the named checkpoints (probe seed 11), printed as a table of
accuracy per distance; with `--png` the figure of `retention.curve` is drawn in Chromium
(`/usr/bin/chromium`, through playwright) and saved as a picture.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from long_grid import load_checkpoints, parse_setting  # noqa: E402


def save_png(fig, path: Path, width: int = 900, height: int = 520) -> None:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        page_file = Path(tmp) / "figure.html"
        fig.update_layout(width=width, height=height)
        fig.write_html(page_file, include_plotlyjs=True, full_html=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": width + 40, "height": height + 40})
            page.goto(page_file.as_uri())
            page.wait_for_selector(".main-svg")
            page.locator(".plotly-graph-div").screenshot(path=str(path))
            browser.close()


def check_output(parser: argparse.ArgumentParser, flag: str, path: Path, folder: bool = False) -> None:
    """Exit with one line naming `flag` when a picture cannot be saved as `path` (with `folder`, in it): a folder
    in the picture's place, a file in the folder's place or above it. Checked before the work, not after it;
    folders that do not exist yet are made when the picture is saved."""
    if not folder and path.is_dir():
        parser.error(f"{flag}: {path} is a folder; give the picture's file name")
    place = path if folder else path.parent
    for above in (place, *place.parents):
        if above.exists():
            if not above.is_dir():
                parser.error(f"{flag}: {above} is a file, not a folder")
            return


def main(argv: list[str] | None = None) -> int:
    from memviz.threads import thread_count
    from memviz_probes import retention

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--distances", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384, 65536])
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--threads", type=thread_count, default=1)
    parser.add_argument("--set", dest="settings", type=parse_setting, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    if args.png:
        check_output(parser, "--png", args.png)
    models = load_checkpoints(parser, args.checkpoints, args.settings)
    torch.set_num_threads(args.threads)
    df = retention.compare(models, args.distances, n=args.n, seed=args.seed, progress=False)
    table = df.pivot_table(index="model", columns="distance", values="correct", aggfunc="mean", sort=False)
    print(f"retention, {args.n} samples a cell, probe seed {args.seed}")
    print("| model | " + " | ".join(f"{d:,}" for d in table.columns) + " |")
    print("|---|" + "---|" * len(table.columns))
    for name, row in table.iterrows():
        print(f"| `{name}` | " + " | ".join(f"{v:.0%}" for v in row) + " |")
    if args.png:
        save_png(retention.curve(df, title=f"Retention: pass key against distance ({args.n} keys a point)"), args.png)
        print(f"saved {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
