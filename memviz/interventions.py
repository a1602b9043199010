"""Interventions on memory: prove which memory read carried an answer.

Each family names its intervention points in the registry (`memviz.registry.Family`). A family
whose state carries a memory from segment to segment offers two, applied at a segment boundary
to the memory part of the state (a `LocalCache`, the local attention's key/value cache, is left
alone): the Infini matrices M and z, LM2's bank, Titans' weights and momentum, LongMem's bank.

  * "reset", `ablate_at(model, segment)`: the memory back to its initial value (forget
    everything before the segment);
  * "patch", `replace_at(model, segment, donor_text)`: the memory the model built from another
    text up to the same position (what would the model answer had it read that instead?).

`answer_logprob` scores the answer under such edits; `ablation_sweep` ablates at each segment
boundary in turn, so the log-probability drops where the evidence was stored. A family with a
parametric memory offers its own points as hooks instead (memory layers: "silence",
`model.silence_hooks(layer, values)`), which `answer_logprob` takes as `fwd_hooks`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from memviz.layers import LocalCache
from memviz.registry import get_family
from memviz.model import ModelState, StateTree

Edit = Callable[[ModelState], ModelState]


def swap_memory(state: StateTree, donor: StateTree) -> StateTree:
    """`state` with every part except local key/value caches (`LocalCache`) taken from `donor`."""
    if isinstance(state, LocalCache):
        return state
    if isinstance(state, dict) and isinstance(donor, dict):
        return {key: swap_memory(value, donor[key]) for key, value in state.items()}
    if isinstance(state, list) and isinstance(donor, list):
        return [swap_memory(a, b) for a, b in zip(state, donor)]
    return donor  # a memory leaf, or a part one side holds as None (Titans' fresh weights)


def swap_state(state: ModelState, donor: ModelState) -> ModelState:
    """`state` at its position with the memory (of every layer and the shared state) of `donor`."""
    return ModelState(state.pos, swap_memory(state.layers, donor.layers), swap_memory(state.shared, donor.shared))


def segment_length(model) -> int:
    """The segment the "reset" and "patch" points sit at the boundaries of."""
    points = get_family(model.family).interventions
    if "reset" not in points:
        offered = f"; it offers {sorted(points)}" if points else ""
        raise ValueError(f"a {model.family} model carries no memory state to reset or patch{offered}")
    seg = model.cfg.segment_len or (model.attention.span if model.attention is not None else None)
    if seg is None:
        raise ValueError(f"a {model.family} model has no segments to intervene at")
    return seg


def ablate_at(model, segment: int) -> tuple[int, Edit]:
    """Reset the memory to its initial value at the start of `segment`."""
    fresh = model.init_state(1)
    return segment * segment_length(model), lambda state: swap_state(state, fresh)


@torch.no_grad()
def replace_at(model, segment: int, donor_text: str) -> tuple[int, Edit]:
    """Put in, at the start of `segment`, the memory the model built from `donor_text` up to
    the same position (the donor must be at least that long)."""
    position = segment * segment_length(model)
    ids = model.tokenizer.encode(donor_text)
    if len(ids) < position:
        raise ValueError(f"the donor text has {len(ids)} tokens; replacing at segment {segment} needs {position}")
    donor = model.init_state(1)
    if position:
        _, donor = model(ids[:position], state=donor, return_state=True)
    return position, lambda state: swap_state(state, donor)


@torch.no_grad()
def answer_logprob(model, prompt: str, answer: str, edits: Sequence[tuple[int, Edit]] = (), fwd_hooks=()) -> dict:
    """log p(answer | prompt) and the greedy answer, streaming the prompt and applying each
    (position, edit) to the carried state when the stream reaches that position."""
    ids, answer_ids = model.tokenizer.encode(prompt), model.tokenizer.encode(answer)
    if not ids or not answer_ids:
        raise ValueError("prompt and answer must both be non-empty")
    tokens = ids + answer_ids
    by_position = {p: e for p, e in edits if 0 < p < len(ids)}
    bounds = [0, *sorted(by_position), len(tokens)]
    was_training = model.training
    model.eval()
    try:
        with model.hooks(fwd_hooks=list(fwd_hooks)):
            state, logits = model.init_state(1), []
            for a, b in zip(bounds[:-1], bounds[1:]):
                if a in by_position:
                    state = by_position[a](state)
                chunk_logits, state = model(tokens[a:b], state=state, return_state=True)
                logits.append(chunk_logits[0])
    finally:
        model.train(was_training)
    logits = torch.cat(logits)
    logp = F.log_softmax(logits.float(), -1)
    answer_logp = logp[len(ids) - 1 : len(tokens) - 1].gather(1, torch.tensor(answer_ids)[:, None]).sum().item()
    greedy = model.tokenizer.decode(logits[len(ids) - 1 : len(tokens) - 1].argmax(-1).tolist())
    return {"logprob": answer_logp, "greedy": greedy, "correct": greedy.strip() == answer.strip()}


def reset_rates(model, samples, evidence_name: str) -> dict[str, float]:
    """Exact-answer rate over probe samples (prompt, answer, n_tokens, evidence spans): clean, with the memory
    reset at the start of the question's segment, and at the start of the segment where the
    evidence begins (`reset_at_{evidence_name}_segment`, counted right when that is segment 0)."""
    seg = segment_length(model)
    rates = {"clean": [], "reset_at_question_segment": [], f"reset_at_{evidence_name}_segment": []}
    for s in samples:
        question_seg, evidence_seg = (s.n_tokens - 1) // seg, s.evidence[0][0] // seg
        answer = " " + s.answer
        rates["clean"].append(answer_logprob(model, s.prompt, answer)["correct"])
        rates["reset_at_question_segment"].append(
            answer_logprob(model, s.prompt, answer, [ablate_at(model, question_seg)])["correct"])
        rates[f"reset_at_{evidence_name}_segment"].append(
            answer_logprob(model, s.prompt, answer, [ablate_at(model, evidence_seg)])["correct"] if evidence_seg > 0 else True)
    return {k: round(sum(v) / len(v), 2) for k, v in rates.items()}


@dataclass
class SweepRow:
    segment: int
    position: int
    logprob: float
    delta: float
    greedy: str


def ablation_sweep(model, prompt: str, answer: str, progress: Callable[[int, int], None] | None = None) -> list[SweepRow]:
    """Ablate the memory at each segment boundary of the prompt in turn; `delta` is the change
    in log p(answer) against the clean run. Each ablation reruns the prompt, so the sweep's time
    grows with the square of its length; `progress(done, total)` is called after each run."""
    clean = answer_logprob(model, prompt, answer)["logprob"]
    seg = segment_length(model)
    n_segments = -(-len(model.tokenizer.encode(prompt)) // seg)
    rows = []
    for s in range(1, n_segments):
        result = answer_logprob(model, prompt, answer, [ablate_at(model, s)])
        rows.append(SweepRow(s, s * seg, result["logprob"], result["logprob"] - clean, result["greedy"]))
        if progress is not None:
            progress(s, n_segments - 1)
    return rows
