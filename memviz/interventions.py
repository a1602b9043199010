"""Interventions on memory: prove which memory read carried an answer.

Each family names its intervention points in the registry (`memviz.registry.Family`). A family
whose state carries a memory from segment to segment offers two, applied at a segment boundary
to the fields its state types mark `Memory` (`memviz.state`; caches such as the local attention's
`LocalCache` are left alone): the Infini matrices M and z, LM2's bank, Titans' weights and
momentum, LongMem's bank.

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

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from memviz.protocol import MemoryModel, ModelState, Progress
from memviz.registry import NamedHook, get_family
from memviz.state import misfit, spec_of, with_memory_of

Edit = Callable[[ModelState], ModelState]


def swap_state(state: ModelState, donor: ModelState) -> ModelState:
    """`state` at its position with the memory (of every layer and the shared state) of `donor`, which must be a
    state of the same architecture and layout (ValueError naming what differs; the forward that takes the result
    checks its sizes and dtypes)."""
    if not isinstance(donor, ModelState):
        raise TypeError(f"the donor state must be a ModelState, got {type(donor).__name__}")
    if state.owner and donor.owner and donor.owner != state.owner:
        raise ValueError(
            f"the donor state was made by a model of {donor.owner}, and the state it goes into by one of {state.owner}"
        )
    layout = [(donor.layers, state.layers, "donor.layers"), (donor.shared, state.shared, "donor.shared")]
    different = next((m for a, b, path in layout if (m := misfit(a, spec_of(b), path, sizes=False))), None)
    if different:
        raise ValueError(f"{different}: the donor state comes from another model")
    layers, shared = with_memory_of(state.layers, donor.layers), with_memory_of(state.shared, donor.shared)
    return ModelState(state.pos, layers, shared, state.owner)


def segment_length(model: MemoryModel) -> int:
    """The segment the "reset" and "patch" points sit at the boundaries of."""
    points = get_family(model.family).interventions
    if "reset" not in points:
        offered = f"; it offers {sorted(points)}" if points else ""
        raise ValueError(f"a {model.family} model carries no memory state to reset or patch{offered}")
    seg = model.segment
    if seg is None:
        raise ValueError(f"a {model.family} model has no segments to intervene at")
    return seg


def segment_start(model: MemoryModel, segment: int) -> int:
    """The first token of `segment` (a whole number >= 0; ValueError naming it otherwise)."""
    try:
        index = operator.index(segment)  # an int, or NumPy's, as a DataFrame gives it
    except TypeError:
        index = -1
    if isinstance(segment, bool) or index < 0:
        raise ValueError(f"segment must be a whole number >= 0, got {segment!r}")
    return index * segment_length(model)


def ablate_at(model: MemoryModel, segment: int) -> tuple[int, Edit]:
    """Reset the memory to its initial value at the start of `segment`."""
    position = segment_start(model, segment)
    fresh = model.init_state(1)
    return position, lambda state: swap_state(state, fresh)


@torch.no_grad()
def replace_at(model: MemoryModel, segment: int, donor_text: str) -> tuple[int, Edit]:
    """Put in, at the start of `segment`, the memory the model built from `donor_text` up to
    the same position (the donor must be at least that long)."""
    position = segment_start(model, segment)
    ids = model.tokenizer.encode(donor_text)
    if len(ids) < position:
        raise ValueError(f"the donor text has {len(ids)} tokens; replacing at segment {segment} needs {position}")
    donor = model.init_state(1)
    if position:
        _, donor = model(ids[:position], state=donor, return_state=True)
    return position, lambda state: swap_state(state, donor)


@torch.no_grad()
def answer_logprob(
    model: MemoryModel,
    prompt: str,
    answer: str,
    edits: Sequence[tuple[int, Edit]] = (),
    fwd_hooks: Sequence[NamedHook] = (),
) -> dict:
    """log p(answer | prompt) and the greedy answer, streaming the prompt and applying each
    (position, edit) to the carried state when the stream reaches that position. An edit at 0 changes
    nothing (the state there is the initial one); one past the prompt is refused."""
    ids, answer_ids = prompt_and_answer(model, prompt, answer)
    tokens = ids + answer_ids
    past = [p for p, _ in edits if p >= len(ids)]
    if past:
        raise ValueError(f"an edit at token {past[0]:,} lies past the prompt's {len(ids):,} tokens")
    by_position = {p: e for p, e in edits if p > 0}
    bounds = [0, *sorted(by_position), len(tokens)]
    with model.evaluating(), model.hooks(fwd_hooks=list(fwd_hooks)):
        state = model.init_state(1)
        for a, b in zip(bounds[:-1], bounds[1:]):
            if a in by_position:
                state = by_position[a](state)
            tail, state = run_tail(model, tokens[a:b], state, len(answer_ids) + 1)
    return score_answer(model, tail, answer_ids, answer)


def run_tail(model: MemoryModel, tokens: list[int], state: ModelState, keep: int) -> tuple[Tensor, ModelState]:
    """Stream `tokens` on from `state` in the model's chunks (one call over a long input would
    cost the square of its length): the logits of the last `keep` positions [keep, vocab] and
    the state after them."""
    tail: Tensor | None = None
    for _, logits, chunk_state in model.stream(tokens, state=state):
        tail = logits[0, -keep:] if tail is None else torch.cat([tail, logits[0]])[-keep:]
        state = chunk_state
    if tail is None:
        raise ValueError("no tokens to run")
    return tail, state


def prompt_and_answer(model: MemoryModel, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    ids, answer_ids = model.tokenizer.encode(prompt), model.tokenizer.encode(answer)
    if not ids or not answer_ids:
        raise ValueError("prompt and answer must both be non-empty")
    return ids, answer_ids


def score_answer(model: MemoryModel, logits: Tensor, answer_ids: list[int], answer: str) -> dict:
    """log p(answer) and the greedy answer from `logits` [T, vocab] of a run that ends with the
    answer's tokens (teacher-forced; T > len(answer_ids))."""
    predicting = logits[-len(answer_ids) - 1 : -1]  # the token before the answer up to the one before its last
    logp = F.log_softmax(predicting.float(), -1)
    answer_logp = logp.gather(1, torch.tensor(answer_ids)[:, None]).sum().item()
    greedy = model.tokenizer.decode(predicting.argmax(-1).tolist())
    return {"logprob": answer_logp, "greedy": greedy, "correct": greedy.strip() == answer.strip()}


def reset_rates(model: MemoryModel, samples, evidence_name: str) -> dict[str, float]:
    """Exact-answer rate over probe samples (prompt, answer, n_tokens, evidence spans): clean, with the memory
    reset at the start of the question's segment, and at the start of the segment where the
    evidence begins (`reset_at_{evidence_name}_segment`, counted right when that is segment 0)."""
    seg = segment_length(model)
    rates: dict[str, list[bool]] = {
        "clean": [],
        "reset_at_question_segment": [],
        f"reset_at_{evidence_name}_segment": [],
    }
    for s in samples:
        question_seg, evidence_seg = (s.n_tokens - 1) // seg, s.evidence[0][0] // seg
        answer = " " + s.answer
        rates["clean"].append(answer_logprob(model, s.prompt, answer)["correct"])
        rates["reset_at_question_segment"].append(
            answer_logprob(model, s.prompt, answer, [ablate_at(model, question_seg)])["correct"]
        )
        rates[f"reset_at_{evidence_name}_segment"].append(
            answer_logprob(model, s.prompt, answer, [ablate_at(model, evidence_seg)])["correct"]
            if evidence_seg > 0
            else True
        )
    return {k: round(sum(v) / len(v), 2) for k, v in rates.items()}


@dataclass
class SweepRow:
    segment: int
    position: int
    logprob: float
    delta: float
    greedy: str


@torch.no_grad()
def ablation_sweep(
    model: MemoryModel, prompt: str, answer: str, points: int = 32, progress: Progress | None = None
) -> list[SweepRow]:
    """Ablate the memory at the prompt's segment boundaries in turn (every one, or `points` of them
    evenly spaced from the first to the last when there are more); `delta` is the change in
    log p(answer) against the clean run. One clean pass keeps the state at each chosen boundary,
    and each ablation runs only the rest of the input from there, so the sweep costs at most
    about points / 2 + 1 passes: linear in the prompt's length. `progress(done, total)` counts
    the tokens run."""
    if not isinstance(points, int) or points < 1:
        raise ValueError(f"points must be a positive number of boundaries, got {points!r}")
    ids, answer_ids = prompt_and_answer(model, prompt, answer)
    tokens, seg = ids + answer_ids, segment_length(model)
    n_boundaries = -(-len(ids) // seg) - 1
    segments = (
        sorted({int(round(x)) for x in torch.linspace(1, n_boundaries, min(points, n_boundaries)).tolist()})
        if n_boundaries
        else []
    )
    total = len(tokens) + sum(len(tokens) - s * seg for s in segments)
    done, at_boundary, rows = 0, {}, []

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    keep = len(answer_ids) + 1
    with model.evaluating():
        state = model.init_state(1)
        for a, b in zip([0, *(s * seg for s in segments)], [*(s * seg for s in segments), len(tokens)]):
            tail, state = run_tail(model, tokens[a:b], state, keep)
            at_boundary[b] = state
            advance(b - a)
        clean = score_answer(model, tail, answer_ids, answer)["logprob"]
        for s in segments:
            position = s * seg
            ablated = swap_state(at_boundary[position], model.init_state(1))
            result = score_answer(model, run_tail(model, tokens[position:], ablated, keep)[0], answer_ids, answer)
            rows.append(SweepRow(s, position, result["logprob"], result["logprob"] - clean, result["greedy"]))
            advance(len(tokens) - position)
    return rows
