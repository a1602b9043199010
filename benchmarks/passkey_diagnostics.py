"""Pass-key diagnostics of the long-context samples (recorded in the README and their cards).

  * partial credit: leading key digits right, first digit right, exact;
  * causal evidence: the answer's accuracy when the memory is reset to its initial value at the
    start of the question's segment (the question can no longer read what memory stored), and,
    as a control, when it is reset at the start of the needle's segment (memory keeps the needle,
    loses only the text before it);
  * LongMem: how often its retrieval holds the needle's chunk at the question.

`python benchmarks/passkey_diagnostics.py [SAMPLE ...]` prints JSON.
"""
import json
import sys

import numpy as np

import memviz
from memviz.interventions import reset_rates
from probes import passkey

SEED, N, DEPTHS = 21, 5, (0.1, 0.5, 0.9)


def partial_credit(model, lengths):
    df = passkey.run(model, lengths, DEPTHS, n=N, seed=SEED, progress=False)
    df = df.assign(first_digit_right=df["leading_digits"] > 0)

    def per_length(column):
        return {str(k): round(float(v), 2) for k, v in df.groupby("length")[column].mean().items()}

    return {"mean_leading_digits": per_length("leading_digits"), "first_digit_right": per_length("first_digit_right"),
            "exact": per_length("correct")}


def memory_resets(model, length, n=15):
    """Exact-answer rate clean, with memory reset at the question's segment, and at the needle's."""
    samples = [passkey.seeded_sample(model.tokenizer, length, DEPTHS[i % 3], SEED, i) for i in range(n)]
    return reset_rates(model, samples, "needle")


def longmem_needle_hits(model, lengths, n=15):
    hits = {}
    for length in lengths:
        h = []
        for i in range(n):
            s = passkey.seeded_sample(model.tokenizer, length, DEPTHS[i % 3], SEED, i)
            tr = memviz.trace(model, s.prompt, names=["side_blocks.1.attn.hook_retrieved_pos"])
            pos = tr["side_blocks.1.attn.hook_retrieved_pos"][-1]
            a, b = s.evidence[0]
            h.append(float(((pos >= a - 3) & (pos < b)).any(-1).mean()))
        hits[str(length)] = round(float(np.mean(h)), 2)
    return hits


def main(names):
    out = {}
    for name in names:
        model = memviz.load(name)
        out[name] = partial_credit(model, [256, 512, 1024])
        if model.family != "sliding_window":
            out[name]["memory_resets_at_512"] = memory_resets(model, 512)
        if model.family == "longmem":
            out[name]["needle_chunk_retrieved_at_question_share_of_heads"] = longmem_needle_hits(model, [512, 1024])
        print(name, json.dumps(out[name]), flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:] or ["sliding_window", "infini", "lm2", "titans", "longmem"])
