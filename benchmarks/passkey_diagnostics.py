"""Pass-key diagnostics of the long-context samples (recorded in the README and their cards).

  * partial credit: leading key digits right, first digit right, exact;
  * causal evidence: the answer's accuracy when the memory is reset to its initial value at the
    start of the question's segment (the question can no longer read what memory stored), and,
    as a control, when it is reset at the start of the needle's segment (memory keeps the needle,
    loses only the text before it);
  * LongMem: how often its retrieval holds the needle's chunk where the key's first digit is predicted;
  * `--boundary LENGTH` (segmented models): the exact rate split by whether every token of the
    key is predicted inside the question's segment, or some from the next segment, which sees
    the question only through memory.

`python benchmarks/passkey_diagnostics.py [--boundary LENGTH] [SAMPLE ...]` prints JSON.
"""

import json
import sys

import numpy as np

import memviz
from memviz.interventions import reset_rates
from memviz.registry import get_family, holds_needle
from memviz.trace import first_non_blank
from memviz_probes import passkey

SEED, N, DEPTHS = 21, 5, (0.1, 0.5, 0.9)


def partial_credit(model, lengths):
    df = passkey.run(model, lengths, DEPTHS, n=N, seed=SEED, progress=False)
    df = df.assign(first_digit_right=df["leading_digits"] > 0)

    def per_length(column):
        return {str(k): round(float(v), 2) for k, v in df.groupby("length")[column].mean().items()}

    return {
        "mean_leading_digits": per_length("leading_digits"),
        "first_digit_right": per_length("first_digit_right"),
        "exact": per_length("correct"),
    }


def memory_resets(model, length, n=15):
    """Exact-answer rate clean, with memory reset at the question's segment, and at the needle's."""
    samples = [passkey.seeded_sample(model.tokenizer, length, DEPTHS[i % 3], SEED, i) for i in range(n)]
    return reset_rates(model, samples, "needle")


def up_to_first_digit(tokenizer, sample) -> list[int]:
    """The prompt and the reply's tokens before the key's first digit: its last position predicts that digit, as
    a trace's `read_position` (the tokenizers here write the reply's leading space as a token of its own)."""
    ids = tokenizer.encode(sample.prompt + sample.reply)
    n = len(tokenizer.encode(sample.prompt))
    return ids[: n + first_non_blank([tokenizer.decode([i]) for i in ids[n:]])]


def needle_held_at_question(model, lengths, n=15):
    """`model.needle_hold` of the needle where the key's first digit is predicted, the mean over samples per
    length (None for a family that defines none)."""
    holder = holds_needle(model)
    if holder is None:
        return None
    held = {}
    for length in lengths:
        rows = []
        for i in range(n):
            s = passkey.seeded_sample(model.tokenizer, length, DEPTHS[i % 3], SEED, i)
            hold = holder.needle_hold(up_to_first_digit(model.tokenizer, s), tuple(s.evidence[0]))
            if hold is None:
                return None
            rows.append({label: float(values[-1]) for label, values in hold.items()})
        held[str(length)] = {label: round(float(np.mean([r[label] for r in rows])), 2) for label in rows[0]}
    return held


def crosses_segment(n_prompt: int, n_answer: int, segment_len: int) -> bool:
    """Whether an answer of `n_answer` tokens after a prompt of `n_prompt` is partly predicted
    from a later segment than the question's last token (position n_prompt - 1)."""
    return (n_prompt - 1) % segment_len + n_answer > segment_len


def exact_by_boundary(model, length, n=150):
    """Exact-answer rate where the key stays in the question's segment and where it crosses."""
    if not model.cfg.segment_len:
        raise ValueError(f"a {model.family} model has no segments")
    cells = {"in_question_segment": [], "crosses_into_next_segment": []}
    for i in range(n):
        s = passkey.seeded_sample(model.tokenizer, length, DEPTHS[i % 3], SEED, i)
        n_answer = len(model.tokenizer.encode(" " + s.answer))
        cell = (
            "crosses_into_next_segment"
            if crosses_segment(s.n_tokens, n_answer, model.cfg.segment_len)
            else "in_question_segment"
        )
        cells[cell].append(passkey.score(model.generate(s.prompt, 8), s))
    return {k: {"exact": round(float(np.mean(v)), 2) if v else None, "n": len(v)} for k, v in cells.items()}


def main(names):
    out = {}
    for name in names:
        model = memviz.load(name)
        out[name] = partial_credit(model, [256, 512, 1024])
        if "reset" in get_family(model.family).interventions:
            out[name]["memory_resets_at_512"] = memory_resets(model, 512)
        held = needle_held_at_question(model, [512, 1024])
        if held is not None:
            out[name]["needle_held_at_question"] = held
        print(name, json.dumps(out[name]), flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--boundary"]:
        length, names = int(args[1]), args[2:] or ["infini_long"]
        print(json.dumps({name: exact_by_boundary(memviz.load(name), length) for name in names}, indent=1))
    else:
        main(args or ["sliding_window", "infini_long", "lm2_english_16k", "titans_english_16k", "longmem_english"])
