"""`python -m memviz families`: the family registry, each family with its hooks, figures,
intervention points, quick preset and sample checkpoint."""

from __future__ import annotations

import argparse
import json
import sys

from memviz.models import families


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
    lines += [f"  intervene  {name}: {point.summary}" for name, point in family.interventions.items()]
    if family.readout:
        lines.append("  readout    model.memory_readout: a memory read decomposed over the tokens that wrote it")
    if family.prefix_capacity:
        lines.append(f"  prefix     data.prefix_tokens, up to model.memory.{family.prefix_capacity} (backbone_prefill)")
    if family.quick is not None:
        lines.append(f"  quick      {json.dumps(family.quick)}")
    if family.sample:
        lines.append(f"  sample     {family.sample}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memviz", description="memviz on the command line")
    parser.add_argument("command", choices=["families"], help="families: list the registered families")
    parser.parse_args(argv)
    print("\n\n".join(describe(f) for f in families()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
