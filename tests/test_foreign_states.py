"""A state fed to a model (`model(ids, state=...)`) or patched into its run (`interventions`) is one that model could
have made, or it is refused before anything runs with one ValueError naming the field that does not fit: another
architecture's state (even of the same sizes), another layout, size, dtype or batch, a negative position. Over every
family memviz builds from a config and one released model of each released family (small random ones made by
transformers)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from memviz.interventions import answer_logprob, swap_state
from memviz.protocol import ModelState
from memviz.state import tensors_of
from tests.conftest import FAMILY_CONFIGS, random_ids, small_model

RELEASED = ["qwen3_5_text", "qwen3_next", "kimi_linear", "bamba", "mamba", "xlstm", "recurrent_gemma"]
MODELS = sorted(FAMILY_CONFIGS) + [f"hf:{t}" for t in RELEASED]
PROMPT = "The pass key is 71432. Remember it. " * 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each model, built once for the module: memviz's own families small, the released ones from tiny folders."""
    import memviz
    from memviz.models.released.tiny import tiny_checkpoint

    built = {}
    for name in MODELS:
        if name.startswith("hf:"):
            folder = tmp_path_factory.mktemp(name[3:])
            tiny_checkpoint(folder, name[3:])
            built[name] = memviz.load(folder)
        else:
            built[name] = small_model(name, **FAMILY_CONFIGS[name])
    return built


def ids_of(model) -> torch.Tensor:
    return torch.tensor([model.tokenizer.encode(PROMPT)[:24]])


def state_after(model, n: int = 12) -> ModelState:
    with torch.no_grad():
        _, state = model(ids_of(model)[:, :n], return_state=True)
    return state


def refused(model, state, match: str, batch: int = 1) -> None:
    ids = ids_of(model)[:, 12:].expand(batch, -1)
    with pytest.raises(ValueError, match=match), torch.no_grad():
        model(ids, state=state)


def enlarged(state: ModelState, victim: torch.Tensor, fill: float) -> ModelState:
    """`state` with `victim` one wider in its last dimension, every number `fill`."""
    return state.map(lambda t: torch.full((*t.shape[:-1], t.shape[-1] + 1), fill, dtype=t.dtype) if t is victim else t)


@pytest.mark.parametrize("name", MODELS)
def test_a_state_says_whose_it_is_and_the_model_takes_its_own(models, name):
    model = models[name]
    fresh, state = model.init_state(1), state_after(model)
    assert fresh.owner == state.owner == model.state_owner and model.family in model.state_owner
    assert str(state).startswith(f"ModelState of {model.state_owner} at position 12: ")
    floats = any(t.is_floating_point() for t in tensors_of(state.layers))  # titans_pytorch keeps the tokens alone
    assert f"{state.nbytes():,} bytes" in str(state) and ("float32" in str(state)) == floats
    with torch.no_grad():
        streamed = model(ids_of(model)[:, 12:], state=state)
        whole = model(ids_of(model))[:, 12:]
    torch.testing.assert_close(streamed, whole, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_a_state_that_does_not_fit_is_refused_naming_the_field(models, name):
    """int64 or float64 parts, a negative position, another batch, a part of the wrong size (all zeros, which a
    released model's cache would have skipped, or not), a layer missing."""
    model = models[name]
    state = state_after(model)
    if any(t.is_floating_point() for t in tensors_of(state.layers)):
        field = r"state\.layers\[\d+\]\S*"
        refused(model, state.map(lambda t: t.long()), rf"{field}: torch\.int64, this model's torch\.float32")
        doubled = state.map(lambda t: t.double() if t.is_floating_point() else t)
        refused(model, doubled, rf"{field}: torch\.float64, this model's torch\.float32")
    else:  # titans_pytorch: the tokens read so far, which it reads again
        refused(
            model,
            state.map(lambda t: t.int()),
            r"state\.layers\[0\]\['tokens'\]: torch\.int32, this model's torch\.int64",
        )
    refused(
        model, dataclasses.replace(state, pos=-5), r"state\.pos must be a whole number of tokens, 0 or more; got -5"
    )
    refused(model, dataclasses.replace(state, pos=True), r"state\.pos must be a whole number")
    refused(model, model.init_state(2), "the state holds 2 sequence")
    refused(model, state, "the state holds 1 sequence", batch=2)
    for victim in (t for t in tensors_of(state.layers) if t.numel() and t.is_floating_point()):
        for fill in (0.0, 1.0):
            refused(model, enlarged(state, victim, fill), r"state\.layers\[\d+\]\S*: shape \(.*\), this model's \(")
    refused(model, dataclasses.replace(state, layers=state.layers[:-1]), "parts, this model's .*another model")


@pytest.mark.parametrize("name", MODELS)
def test_another_architecture_s_state_is_refused_fed_or_patched(models, name):
    """The next model's state, fed directly or swapped in as a donor's memory mid-prompt, named as whose it is; the
    same state with its owner taken off (built by hand) is refused by its layout or sizes where they differ."""
    model, other = models[name], models[MODELS[(MODELS.index(name) + 1) % len(MODELS)]]
    foreign = state_after(other)
    theirs, ours = re.escape(other.state_owner), re.escape(model.state_owner)
    refused(model, foreign, rf"made by a model of {theirs}, and this model is of {ours}")
    with pytest.raises(ValueError, match=rf"the donor state was made by a model of {theirs}"):
        answer_logprob(model, PROMPT, "71432", [(8, lambda state: swap_state(state, foreign))])
    unnamed = dataclasses.replace(foreign, owner="")  # built by hand: only its layout and sizes can tell
    if model.state_misfit(unnamed, 1) is not None:
        refused(model, unnamed, "it comes from another model|the state does not fit this")
    with pytest.raises(TypeError, match="the donor state must be a ModelState"):
        swap_state(state_after(model), foreign.layers)  # type: ignore[arg-type]


def test_a_qwen3_next_state_of_qwen3_5_s_sizes_is_refused(models):
    """The two architectures' tiny models carry states of the same layout and sizes; their memories mean different
    things (the logits move when one is fed the other's), so the owner refuses it, fed or patched."""
    qwen3_5, qwen3_next = models["hf:qwen3_5_text"], models["hf:qwen3_next"]
    theirs, ours = state_after(qwen3_next), state_after(qwen3_5)
    assert [t.shape for t in tensors_of(theirs.layers)] == [t.shape for t in tensors_of(ours.layers)]
    assert qwen3_5.state_misfit(theirs, 1) is None  # only the owner tells them apart
    refused(qwen3_5, theirs, r"made by a model of hf_gated_deltanet \(qwen3_next\)")
    with pytest.raises(ValueError, match=r"donor state was made by a model of hf_gated_deltanet \(qwen3_next\)"):
        swap_state(ours, theirs)


def test_a_state_built_by_hand_is_checked_by_its_layout_and_sizes():
    """A state with no owner (a notebook's own) is taken where it fits and refused where it does not."""
    model = small_model("infini", **FAMILY_CONFIGS["infini"])
    ids = random_ids(16)
    with torch.no_grad():
        _, state = model(ids[:, :8], return_state=True)
        expected = model(ids[:, 8:], state=state)
        by_hand = ModelState(state.pos, state.layers, state.shared)
        torch.testing.assert_close(model(ids[:, 8:], state=by_hand), expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="state.layers: 1 parts, this model's 2; it comes from another model"):
        model(ids[:, 8:], state=ModelState(8, state.layers[:1]))


def test_a_sample_s_state_patched_into_a_released_model_is_refused_by_its_layout(models):
    """An Infini-attention state with its owner taken off, swapped into a released model's run: one ValueError
    naming the part, not an AttributeError from inside the swap."""
    unnamed = dataclasses.replace(state_after(models["infini"]), owner="")
    qwen = state_after(models["hf:qwen3_5_text"])
    with pytest.raises(
        ValueError, match=r"^donor\.layers: 2 parts, this model's 4: the donor state comes from another"
    ):
        swap_state(qwen, unnamed)
    four = dataclasses.replace(unnamed, layers=unnamed.layers * 2)  # as many layers: their type tells
    with pytest.raises(ValueError, match=r"^donor\.layers\[0\]: a \w+, this model's a MemoryLayerState: the donor"):
        swap_state(qwen, four)
