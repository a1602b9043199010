"""Why a checkpoint does or does not answer qa1 ("Where is Mary?"), on bare stories in view.

  * recency: accuracy split by whether the answer is the last room mentioned, and how often the
    model says that last room;
  * name use: the KL between the answers to "Where is A?" and "Where is B?" on the same story
    (0 when the answer ignores the name asked) and how often the top answer stays the same;
  * binding: a linear probe per layer that reads each move's actor from the residual stream at
    the period ending the move (chance 1/4), trained on 70% of the moves, scored on the rest;
  * with --resets LENGTH (a model with segments or a bank): qa1 at LENGTH tokens answered clean,
    with the memory reset at the start of the question's segment (the question can read nothing
    the memory stored), and, as a control, reset at the start of the answer's fact's segment
    (the memory still stores that fact and what follows it); for an LM2 with addressed writes
    (`write` `slots`), also how much of each slot's write in the answering fact's segment lands
    on that fact's tokens, per layer, against the fact's share of the segment's tokens;
  * with --toy STEPS: trains a fresh model of the checkpoint's shape on two-fact stories
    ("A went to the X. B went to the Y." then "Where is A?") and prints loss and accuracy;
    a model that binds reaches ~100%, one that only finds the rooms stays at ln 2.
    --fan-in trains it with init "fan_in" and embed_scale sqrt(d_model) instead of the
    checkpoint's own init.

`python benchmarks/qa1_diagnostics.py CHECKPOINT [--resets LENGTH] [--toy STEPS [--fan-in]]` prints JSON.
"""

import argparse
import functools
import json
import random

import numpy as np
import torch
import torch.nn.functional as F

import memviz
from memviz.interventions import reset_rates
from memviz.models import build_model
from memviz.models.lm2 import segment_softmax
from memviz_probes import babilong

ACTORS, ROOMS = list(babilong.BABI.actors), list(babilong.BABI.rooms)


def answer_logits(model, text):
    """Log-probabilities over the six rooms at the end of `text`."""
    ids = torch.tensor([model.tokenizer.encode(text)])
    with torch.no_grad():
        logits = model(ids)[0, -1]
    return torch.log_softmax(logits[room_ids(model)], -1)


@functools.cache
def room_ids(model):
    """Token ids of the six rooms, encoded once per model."""
    return [model.tokenizer.encode(" " + r)[0] for r in ROOMS]


def stories(seed, n):
    rng = random.Random(f"qa1-diagnostics-{seed}")
    return [babilong.make_story("qa1", rng) for _ in range(n)]


def prompt(facts, question):
    return " " + " ".join(facts) + babilong.question_suffix(question)


def recency(model, n=300):
    counts = {k: [0, 0, 0] for k in ("answer_is_last_room", "answer_is_not_last_room")}
    for st in stories(0, n):
        said = ROOMS[int(answer_logits(model, prompt(st.facts, st.question)).argmax())]
        last = st.facts[-1].rstrip(".").split()[-1]
        c = counts["answer_is_last_room" if st.answer == last else "answer_is_not_last_room"]
        c[0], c[1], c[2] = c[0] + 1, c[1] + (said == st.answer), c[2] + (said == last)
    return {
        k: {"n": c[0], "right": round(c[1] / c[0], 2), "says_last_room": round(c[2] / c[0], 2)}
        for k, c in counts.items()
    }


def name_use(model, n=100):
    kls, same = [], []
    for st in stories(1, n):
        names = sorted({f.split()[0] for f in st.facts})[:2]
        if len(names) < 2:
            continue
        p, q = (answer_logits(model, prompt(st.facts, f"Where is {a}?")) for a in names)
        kls.append(float((p.exp() * (p - q)).sum()))
        same.append(bool(p.argmax() == q.argmax()))
    return {"mean_kl": float(sum(kls) / len(kls)), "same_top_answer": round(sum(same) / len(same), 2)}


def binding(model, n=400):
    """Held-out accuracy of a linear read-out of the mover from the period after each move."""
    rooms = set(room_ids(model))
    feats, labels = [], []
    for st in stories(2, n):
        ids = model.tokenizer.encode(" " + " ".join(st.facts))
        _, cache = model.run_with_cache(torch.tensor([ids]))
        periods = [i + 1 for i, t in enumerate(ids) if t in rooms]
        labels += [ACTORS.index(f.split()[0]) for f in st.facts]
        feats.append(torch.stack([cache[f"blocks.{l}.hook_resid_post"][0, periods] for l in range(model.cfg.n_layers)]))
    x, y = torch.cat(feats, 1).detach(), torch.tensor(labels)
    split, out = int(0.7 * len(y)), {}
    torch.manual_seed(0)
    for layer, xs in enumerate(x):
        xs = (xs - xs[:split].mean(0)) / (xs[:split].std(0) + 1e-5)
        w = torch.zeros(xs.shape[1], len(ACTORS), requires_grad=True)
        b = torch.zeros(len(ACTORS), requires_grad=True)
        opt = torch.optim.Adam([w, b], lr=0.05)
        for _ in range(300):
            loss = F.cross_entropy(xs[:split] @ w + b, y[:split]) + 1e-3 * w.pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        out[f"layer_{layer}"] = round(float(((xs[split:] @ w + b).argmax(1) == y[split:]).float().mean()), 3)
    return out


def memory_resets(model, length, n=60, seed=11):
    """Exact-answer rate on qa1 at `length` tokens: clean, memory reset at the question's segment,
    and reset at the segment of the fact that holds the answer (qa1's one supporting fact)."""
    samples = [babilong.seeded_sample(model.tokenizer, "qa1", length, seed, i) for i in range(n)]
    return reset_rates(model, samples, "answer_fact")


def slot_writes(model, length, n=30, seed=13):
    """Per layer, the mean share of a slot's write (its softmax over the segment's tokens) that
    falls on the answering fact, over stories whose fact lies inside one segment before the
    question's, and how many of the slots put more than half their write there."""
    L, shares, fact_share = model.cfg.segment_len, [], []
    for i in range(n):
        sample = babilong.seeded_sample(model.tokenizer, "qa1", length, seed, i)
        ids = torch.tensor([model.tokenizer.encode(sample.prompt)])
        start, end = sample.evidence[-1]
        seg = start // L
        if end > (seg + 1) * L or (seg + 1) * L >= ids.shape[1]:
            continue
        _, cache = model.run_with_cache(ids, names_filter=lambda name: name.endswith("hook_write_score"))
        fact_share.append((end - start) / L)
        shares.append(
            [
                segment_softmax(cache[f"blocks.{layer}.memory.hook_write_score"][0].numpy(), L)[start:end].sum(0)
                for layer in range(model.cfg.n_layers)
            ]
        )
    shares = np.array(shares)  # [stories, layers, slots]
    return {
        "stories": len(fact_share),
        "fact_share_of_segment": round(float(np.mean(fact_share)), 3),
        **{
            f"layer_{layer}": {
                "write_on_fact": round(float(shares[:, layer].mean()), 3),
                "slots_over_half": round(float((shares[:, layer] > 0.5).sum(-1).mean()), 1),
            }
            for layer in range(model.cfg.n_layers)
        },
    }


def toy(model, steps, fan_in=False, lr=1e-3, batch=32):
    """Train a fresh model of this shape on two-fact stories; loss and accuracy every 250 steps."""
    torch.manual_seed(0)
    cfg = model.cfg.replace(init="fan_in", embed_scale=model.cfg.d_model**0.5) if fan_in else model.cfg
    fresh, tok, rng, log = build_model(cfg), model.tokenizer, random.Random(0), []
    rid = torch.tensor(room_ids(model))
    opt = torch.optim.AdamW(fresh.parameters(), lr=lr)
    for step in range(steps + 1):
        xs, ys = [], []
        for _ in range(batch):
            who, where, q = rng.sample(ACTORS, 2), [rng.choice(ROOMS) for _ in range(2)], rng.randrange(2)
            facts = [f"{a} went to the {r}." for a, r in zip(who, where)]
            xs.append(tok.encode(prompt(facts, f"Where is {who[q]}?")))
            ys.append(ROOMS.index(where[q]))
        logits = fresh(torch.tensor(xs))[:, -1][:, rid]
        loss = F.cross_entropy(logits, torch.tensor(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 250 == 0:
            acc = float((logits.argmax(1) == torch.tensor(ys)).float().mean())
            log.append({"step": step, "loss": round(loss.item(), 3), "accuracy": round(acc, 2)})
    return log


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--resets", type=int, default=0, metavar="LENGTH")
    parser.add_argument("--toy", type=int, default=0, metavar="STEPS")
    parser.add_argument(
        "--fan-in", action="store_true", help="train the toy with init fan_in and embed_scale sqrt(d_model)"
    )
    args = parser.parse_args()
    model = memviz.load(args.checkpoint).eval()
    report = {
        "checkpoint": args.checkpoint,
        "recency": recency(model),
        "name_use": name_use(model),
        "binding": binding(model),
    }
    if args.resets:
        report["memory_resets"] = memory_resets(model, args.resets)
        if model.cfg.memory.get("write") == "slots":  # LM2's slot-wise writes
            report["slot_writes"] = slot_writes(model, args.resets)
    if args.toy:
        report["toy"] = toy(model, args.toy, fan_in=args.fan_in)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
