"""What every family promises: training moves every parameter, a streamed run equals one pass."""

import pytest
import torch

from tests.conftest import FAMILY_CONFIGS, random_ids, small_model


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_twenty_training_steps_move_every_parameter(family):
    """A toy copy task: the second half of each sequence repeats the first. Every trainable
    parameter must get a gradient and move (LongMem's frozen backbone must not)."""
    model = small_model(family, **FAMILY_CONFIGS[family]).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(20):
        half = torch.randint(0, 16, (4, 16), generator=g)
        tokens = torch.cat([half, half], dim=1)
        loss = model(tokens, return_type="loss")
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad), "a parameter got no gradient"
        optimizer.step()
        losses.append(loss.item())
    unmoved = [n for n, p in model.named_parameters() if p.requires_grad and torch.equal(p.detach(), before[n])]
    assert not unmoved, f"parameters that never moved: {unmoved}"
    frozen_moved = [
        n for n, p in model.named_parameters() if not p.requires_grad and not torch.equal(p.detach(), before[n])
    ]
    assert not frozen_moved, f"frozen parameters that moved: {frozen_moved}"
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_the_residual_return_unembedded_is_the_logits(family):
    """What the training loss reads instead of the logits (training.loss.unembedded_loss); a peer that makes
    its logits in its own library has none."""
    model = small_model(family, **FAMILY_CONFIGS[family])
    ids = random_ids(45)
    if family == "titans_pytorch":
        assert not model.unembeds_last
        with pytest.raises(ValueError, match="makes its logits its own way"):
            model(ids, return_type="residual")
        return
    with torch.no_grad():
        residual, state = model(ids, return_type="residual", return_state=True)
        logits, expected_state = model(ids, return_state=True)
    assert model.unembeds_last and residual.shape == (1, 45, model.cfg.d_model)
    torch.testing.assert_close(model.unembed(residual), logits, atol=0, rtol=0)
    assert state.pos == expected_state.pos == 45


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_streamed_run_equals_one_pass_for_every_family(family):
    model = small_model(family, **FAMILY_CONFIGS[family])
    ids = random_ids(45)
    with torch.no_grad():
        one_pass = model(ids)
        streamed = torch.cat([lg for _, lg, _ in model.stream(ids, 6)], dim=1)
    torch.testing.assert_close(streamed, one_pass, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_every_family_runs_in_float64_and_bfloat16_by_model_to(family):
    """`model.to(dtype)` is enough: states are built in the model's dtype, rotary tables cast."""
    model = small_model(family, **FAMILY_CONFIGS[family])
    ids = random_ids(45)
    with torch.no_grad():
        reference = model(ids)
        wide = model.to(torch.float64)
        one_pass = wide(ids)
        streamed = torch.cat([lg for _, lg, _ in wide.stream(ids, 6)], dim=1)
        narrow = model.to(torch.bfloat16)(ids)
    assert one_pass.dtype == torch.float64 and narrow.dtype == torch.bfloat16
    torch.testing.assert_close(streamed, one_pass, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(one_pass.float(), reference, atol=1e-4, rtol=1e-4)
    worst_per_position = (narrow.float() - reference).abs().amax(-1).flatten()
    if any(name.endswith("hook_topk_indices") for name in model.hook_dict):
        # a product-key top-k may pick another value at a few positions under bf16 rounding
        worst_per_position = worst_per_position.quantile(0.8)
    assert worst_per_position.max() < 0.25 * reference.std()


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_what_a_family_declares_it_can_do_is_what_its_model_does(family):
    """The registry's capabilities, which the app and training ask, against the model itself: a declared
    read-out or needle hold is a method the model has and answers, a declared prefix memory is filled by the
    backbone alone, a hook intervention's hooks change the logits at each site it names."""
    import memviz
    from memviz.registry import get_family

    spec = get_family(family)
    model = small_model(family, **FAMILY_CONFIGS[family])
    ids = random_ids(20, seed=3)
    assert spec.readout == hasattr(model, "memory_readout") and spec.needle_hold == hasattr(model, "needle_hold")
    reader, holder = memviz.registry.reads_out(model), memviz.registry.holds_needle(model)
    if reader is not None:
        readout = reader.memory_readout(ids, 19)
        assert readout is None or (readout.position == 19 and readout.parts), readout
    if holder is not None:
        hold = holder.needle_hold(ids, (2, 5))
        assert hold is None or all(values.shape == (20,) for values in hold.values()), hold
    assert (spec.prefix_capacity is not None) == hasattr(model, "backbone_prefill")
    if spec.prefix_capacity is not None:
        assert getattr(model.options, spec.prefix_capacity) > 0
    with torch.no_grad():
        clean = model(ids)
        for name, point in spec.interventions.items():
            if point.through_hooks:
                assert point.sites(model), name
                for site in point.sites(model):
                    edited = model.run_with_hooks(ids, fwd_hooks=point.hooks(model, site))
                    assert not torch.allclose(edited, clean), (name, site)
