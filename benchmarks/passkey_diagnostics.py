"""Partial-credit pass-key diagnostics of the long-context samples (recorded in their cards):
leading digits right, and how often LongMem's retrieval holds the needle at the question."""
import json
import numpy as np
import memviz
from probes import passkey

out = {}
for name in ("sliding_window", "longmem"):
    m = memviz.load(name)
    df = passkey.run(m, [512, 1024], [0.1, 0.5, 0.9], n=5, seed=21, progress=False)
    out[name] = {"mean_leading_digits": {str(k): round(float(v), 2) for k, v in df.groupby("length")["leading_digits"].mean().items()},
                 "first_digit_right": {str(k): round(float(v), 2) for k, v in df.assign(f=df["leading_digits"] > 0).groupby("length")["f"].mean().items()},
                 "exact": {str(k): round(float(v), 2) for k, v in df.groupby("length")["correct"].mean().items()}}
    if name == "longmem":
        hits = {}
        for length in (512, 1024):
            h = []
            for i in range(15):
                s = passkey.seeded_sample(m.tokenizer, length, [0.1, 0.5, 0.9][i % 3], 21, i)
                tr = memviz.trace(m, s.prompt, names=["side_blocks.1.attn.hook_retrieved_pos"])
                pos = tr["side_blocks.1.attn.hook_retrieved_pos"][-1]
                a, b = s.evidence[0]
                h.append(float(((pos >= a - 3) & (pos < b)).any(-1).mean()))
            hits[str(length)] = round(float(np.mean(h)), 2)
        out[name]["needle_chunk_retrieved_at_question_share_of_heads"] = hits
print(json.dumps(out, indent=1))
