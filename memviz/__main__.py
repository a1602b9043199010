"""`python -m memviz families`: the family registry, each family with its hooks, figures,
intervention points, quick preset and sample checkpoint. `python -m memviz hooks`: the hook table of
docs/hooks.md, made from the families' `hook_docs`. `python -m memviz state-rank CHECKPOINT --text FILE`: the
effective and stable rank of each head's matrix memory over a text (`memviz.state_rank`), as CSV and HTML figures."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from memviz.models import families
from memviz.registry import Family


def describe(family) -> str:
    lines = [
        f"{family.name} ({family.role}): {family.summary}",
        f"  model      {family.model.__module__}.{family.model.__name__}",
    ]
    lines += [f"  hook       {name}  (traced as {reducer})" for name, reducer in family.hooks.items()]
    if family.figures is not None:
        lines.append(
            f"  figures    {family.figures.__module__}.{family.figures.__name__}: "
            f"{' '.join(family.figures.__doc__.split())}"
        )
    if family.read_at is not None:
        lines.append(
            f"  read at    {family.read_at.__module__}.{family.read_at.__name__}: "
            f"{' '.join((family.read_at.__doc__ or '').split())}"
        )
    if family.matrix_state:
        lines.append(f"  state rank {', '.join(family.matrix_state)} (memviz.state_rank)")
    lines += [f"  intervene  {name}: {point.summary}" for name, point in family.interventions.items()]
    if family.readout:
        lines.append("  readout    model.memory_readout: a memory read decomposed over the tokens that wrote it")
    if family.needle_hold:
        lines.append("  hold       model.needle_hold: how much of a span's writes the memory still holds")
    if family.prefix_capacity:
        lines.append(f"  prefix     data.prefix_tokens, up to model.memory.{family.prefix_capacity} (backbone_prefill)")
    if family.quick is not None:
        lines.append(f"  quick      {json.dumps(family.quick)}")
    if family.sample:
        lines.append(f"  sample     {family.sample}")
    return "\n".join(lines)


def hook_table(listed: Sequence[Family]) -> str:
    """The markdown table of every hook the families declare: one row a (hook, shape, meaning), with the
    families that have it ("all", or "all except ..." when at most three lack it)."""
    names = [f.name for f in listed if f.hook_docs]
    rows: dict[tuple[str, str, str], list[str]] = {}
    for family in listed:
        for hook, doc in family.hook_docs.items():
            rows.setdefault((hook, doc.shape, doc.what), []).append(family.name)
    lines = ["| hook | families | shape | what it is |", "|---|---|---|---|"]
    for (hook, shape, what), having in rows.items():
        lacking = [n for n in names if n not in having]
        who = ", ".join(having) if len(lacking) > 3 else "all" + (" except " + ", ".join(lacking) if lacking else "")
        lines.append(f"| `{hook}` | {who} | `{shape}` | {what} |")
    return "\n".join(lines) + "\n"


def state_rank_command(args: argparse.Namespace) -> int:
    """Measure, write state_rank.csv and one HTML figure a layer and memory under --out, print the mean ranks."""
    import re
    from pathlib import Path

    import memviz
    from memviz import viz
    from memviz.files import CheckpointError
    from memviz.state_rank import state_ranks

    text_path = Path(args.text)
    try:
        text = text_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: --text {text_path}: {exc}", file=sys.stderr)
        return 2
    try:
        ranks = state_ranks(memviz.load(args.checkpoint), text, every=args.every)
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ranks.to_csv(out / "state_rank.csv", index=False)
    for title, fig in viz.state_rank_figures(ranks).items():
        fig.write_html(out / f"{re.sub(r'[^a-z0-9]+', '_', title.lower()).strip('_')}.html")
    means = ranks.groupby(["layer", "memory"], sort=False)[["effective_rank", "stable_rank"]].mean()
    print(means.round(2).to_string())
    print(f"{len(ranks):,} rows in {out / 'state_rank.csv'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memviz", description="memviz on the command line")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{families,hooks,state-rank}")
    commands.add_parser("families", help="list the registered families")
    commands.add_parser("hooks", help="the hook table (docs/hooks.md)")
    rank = commands.add_parser("state-rank", help="each head's matrix memory's rank over a text")
    rank.add_argument("checkpoint", help="a sample's name or a checkpoint folder")
    rank.add_argument("--text", required=True, help="a UTF-8 text file to read")
    rank.add_argument("--every", type=int, default=None, help="tokens between measured states (default: a chunk)")
    rank.add_argument("--out", default="state_rank", help="the folder for state_rank.csv and the figures")
    args = parser.parse_args(argv)
    if args.command == "state-rank":
        return state_rank_command(args)
    if args.command == "hooks":
        print(hook_table(families()), end="")
        return 0
    print("\n\n".join(describe(f) for f in families()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
