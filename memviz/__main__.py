"""`python -m memviz families`: the family registry, each family with its hooks, figures,
intervention points, quick preset and sample checkpoint. `python -m memviz hooks`: the hook table of
docs/hooks.md, made from the families' `hook_docs`. `python -m memviz state-rank CHECKPOINT --text FILE`: the
effective and stable rank of each head's matrix memory over a text (`memviz.state_rank`), as CSV and HTML figures.
`python -m memviz write-dictionary CHECKPOINT --text FILE --layer L`: a dictionary of rank-1 atoms trained on a
layer's writes over a text (`memviz.write_dictionary`), saved as safetensors with a card, its atoms as CSV.
`python -m memviz read-lens CHECKPOINT --text FILE [--position N]`: what each memory layer's read at a token promotes
through the rest of the model, and the writers behind it (`memviz.read_lens`), as CSV and HTML figures."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from memviz.models import families
from memviz.read_lens import PROMOTED, WRITERS
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
    if family.read_lens:
        lines.append("  read lens  model.read_path: a read's logits through the rest of the model (memviz.read_lens)")
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


def text_argument(path: Path) -> str | None:
    """--text's contents, or None after one error line naming the file."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: --text {path}: {exc}", file=sys.stderr)
        return None


def html_name(title: str) -> str:
    """A figure's file name from its title: "blocks.0 S state rank" as blocks_0_s_state_rank.html."""
    return f"{re.sub(r'[^a-z0-9]+', '_', title.lower()).strip('_')}.html"


def state_rank_command(args: argparse.Namespace) -> int:
    """Measure, write state_rank.csv and one HTML figure a layer and memory under --out, print the mean ranks."""
    import memviz
    from memviz import viz
    from memviz.files import CheckpointError
    from memviz.state_rank import state_ranks

    text_path = Path(args.text)
    text = text_argument(text_path)
    if text is None:
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
        fig.write_html(out / html_name(title))
    means = ranks.groupby(["layer", "memory"], sort=False)[["effective_rank", "stable_rank"]].mean()
    print(means.round(2).to_string())
    print(f"{len(ranks):,} rows in {out / 'state_rank.csv'}")
    return 0


def read_lens_command(args: argparse.Namespace) -> int:
    """Write read_lens_promoted.csv, read_lens_writers.csv and one HTML figure a layer under --out; print each layer's
    promoted tokens and strongest writers."""
    import pandas as pd

    import memviz
    from memviz.files import CheckpointError, check_writable_folder
    from memviz.read_lens import read_lens, read_lens_figures

    text_path = Path(args.text)
    text = text_argument(text_path)
    if text is None:
        return 2
    out = Path(args.out)
    try:
        check_writable_folder(out, "--out")
        for option, value in (("--promoted", args.promoted), ("--writers", args.writers)):
            if value < 1:
                raise ValueError(f"{option} must be at least 1, got {value}")
        model = memviz.load(args.checkpoint)
        ids = model.tokenizer.encode(text)
        if not ids:
            raise ValueError(f"--text {text_path} holds no tokens")
        position = len(ids) - 1 if args.position is None else args.position
        if not 0 <= position < len(ids):
            raise ValueError(f"--position must be a token of the text, 0 to {len(ids) - 1}; got {position}")
        lens = read_lens(model, ids, position, promoted=args.promoted, writers=args.writers)
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    layers = lens.layers.items()
    pd.concat([t.promoted.assign(layer=name) for name, t in layers]).to_csv(out / "read_lens_promoted.csv", index=False)
    pd.concat([t.writers.assign(layer=name) for name, t in layers]).to_csv(out / "read_lens_writers.csv", index=False)
    for title, fig in read_lens_figures(lens).items():
        fig.write_html(out / html_name(title))
    print(f"the reads at token {position} ({lens.token!r}):")
    for name, layer in layers:
        promoted = " ".join(f"{t!r} {v:+.2f}" for t, v in zip(layer.promoted["token"][:5], layer.promoted["logit"][:5]))
        writers = ", ".join(f"{t!r} at {p}" for p, t in zip(layer.writers["position"][:3], layer.writers["token"][:3]))
        print(f"  {name}: promotes {promoted}; written most by {writers or 'no token yet: its initial state alone'}")
    print(f"tables and figures in {out}")
    return 0


def head_list(text: str) -> list[int]:
    """--heads "0,2" as [0, 2]; ValueError naming the option otherwise."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"--heads must be head numbers separated by commas, got {text!r}")
    return [int(p) for p in parts]


def write_dictionary_command(args: argparse.Namespace) -> int:
    """Train on --text, write dictionary.safetensors, card.json, atoms.csv and two HTML figures under --out, print
    what it measured and what the most frequent atoms fire on."""
    import shlex

    import memviz
    from memviz.files import CheckpointError, check_writable_folder
    from memviz.write_dictionary import (
        atom_figures,
        atom_table,
        encode_writes,
        logit_effects,
        save_dictionary,
        train_on_text,
    )

    text_path = Path(args.text)
    text = text_argument(text_path)
    if text is None:
        return 2
    out = Path(args.out)
    try:
        check_writable_folder(out, "--out")
        heads = None if args.heads is None else head_list(args.heads)
        model = memviz.load(args.checkpoint)
        dictionary, writes = train_on_text(
            model,
            text,
            args.layer,
            heads,
            max_tokens=args.max_tokens,
            n_atoms=args.atoms,
            k=args.k,
            steps=args.steps,
            batch=args.batch,
            seed=args.seed,
        )
        codes = encode_writes(dictionary, writes)
        table = atom_table(dictionary, writes, codes, top=args.top)
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    options = ["--text", args.text, "--layer", args.layer, "--atoms", args.atoms, "--k", args.k, "--steps", args.steps]
    options += ["--batch", args.batch, "--seed", args.seed, "--max-tokens", args.max_tokens, "--top", args.top]
    options += ["--effects", args.effects, "--out", args.out]
    options += [] if args.heads is None else ["--heads", args.heads]
    command = shlex.join(["python", "-m", "memviz", "write-dictionary", args.checkpoint, *map(str, options)])
    # saved before the logit effects (a forward pass each), so that nothing trained is lost if they fail
    save_dictionary(dictionary, out, {"checkpoint": args.checkpoint, "text": str(text_path), "command": command})
    table.to_csv(out / "atoms.csv", index=False)
    if args.effects > 0:
        picks = [(h, int(a)) for h in dictionary.heads for a in table[table["head"] == h]["atom"].head(args.effects)]
        try:
            effects = logit_effects(model, dictionary, writes, table, picks)
            table = table.merge(effects[["head", "atom", "promoted"]], on=["head", "atom"], how="left")
        except ValueError as exc:  # a family with no linear path from its read to the logits
            print(f"no logit effects: {exc}", file=sys.stderr)
    table.to_csv(out / "atoms.csv", index=False)
    for title, fig in atom_figures(dictionary, writes, table, codes).items():
        fig.write_html(out / f"{title.replace(' ', '_')}.html")
    card = dictionary.card
    print(
        f"layer {card['layer']}: {card['tokens']:,} writes ({card['held_back_tokens']:,} held back), "
        f"{dictionary.n_atoms} atoms a head, k = {dictionary.k}, trained in {card['wall_time_s']:.0f} s"
    )
    for row, head in enumerate(dictionary.heads):
        print(
            f"head {head}: explained variance {card['explained_variance'][row] or float('nan'):.3f} on the held-back "
            "writes, "
            f"{card['dead_atoms'][row]} dead atoms"
        )
        for atom in table[table["head"] == head].head(3).itertuples():
            print(f"  atom {atom.atom} fires on {atom.frequency:.1%}: {atom.fires_on[:150]}")
            if isinstance(getattr(atom, "promoted", None), str):
                print(f"    its value direction promotes {atom.promoted}")
    print(f"saved in {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memviz", description="memviz on the command line")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="{families,hooks,state-rank,write-dictionary,read-lens}"
    )
    commands.add_parser("families", help="list the registered families")
    commands.add_parser("hooks", help="the hook table (docs/hooks.md)")
    rank = commands.add_parser("state-rank", help="each head's matrix memory's rank over a text")
    rank.add_argument("checkpoint", help="a sample's name or a checkpoint folder")
    rank.add_argument("--text", required=True, help="a UTF-8 text file to read")
    rank.add_argument("--every", type=int, default=None, help="tokens between measured states (default: a chunk)")
    rank.add_argument("--out", default="state_rank", help="the folder for state_rank.csv and the figures")
    dictionary = commands.add_parser("write-dictionary", help="a dictionary of rank-1 atoms of a layer's writes")
    dictionary.add_argument("checkpoint", help="a sample's name or a checkpoint folder")
    dictionary.add_argument("--text", required=True, help="a UTF-8 text file to read")
    dictionary.add_argument("--layer", type=int, required=True, help="a layer with writes (hook_write_key)")
    dictionary.add_argument("--heads", default=None, help="heads to train on, comma-separated (default: all)")
    dictionary.add_argument("--atoms", type=int, default=256, help="atoms a head (default 256)")
    dictionary.add_argument("--k", type=int, default=4, help="atoms a write (TopK; default 4)")
    dictionary.add_argument("--steps", type=int, default=2000, help="Adam steps (default 2000)")
    dictionary.add_argument("--batch", type=int, default=1024, help="writes a step (default 1024)")
    dictionary.add_argument("--seed", type=int, default=0)
    dictionary.add_argument("--max-tokens", type=int, default=200_000, help="refuse a longer text (default 200,000)")
    dictionary.add_argument("--top", type=int, default=5, help="strongest writes listed an atom (default 5)")
    dictionary.add_argument(
        "--effects", type=int, default=2, help="the most frequent atoms a head whose logit effect is taken (default 2)"
    )
    dictionary.add_argument("--out", default="write_dictionary", help="the folder for the dictionary and its atoms")
    lens = commands.add_parser("read-lens", help="what each memory layer's read at a token promotes, and who wrote it")
    lens.add_argument("checkpoint", help="a sample's name or a checkpoint folder")
    lens.add_argument("--text", required=True, help="a UTF-8 text file to read")
    lens.add_argument("--position", type=int, default=None, help="the token read at (default: the last)")
    lens.add_argument("--promoted", type=int, default=PROMOTED, help=f"tokens listed a layer (default {PROMOTED})")
    lens.add_argument("--writers", type=int, default=WRITERS, help=f"writers listed a layer (default {WRITERS})")
    lens.add_argument("--out", default="read_lens", help="the folder for the tables and the figures")
    args = parser.parse_args(argv)
    if args.command == "read-lens":
        return read_lens_command(args)
    if args.command == "write-dictionary":
        return write_dictionary_command(args)
    if args.command == "state-rank":
        return state_rank_command(args)
    if args.command == "hooks":
        print(hook_table(families()), end="")
        return 0
    print("\n\n".join(describe(f) for f in families()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
