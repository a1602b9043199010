"""Hooks: each family declares the hooks its model has, docs/hooks.md is made from those, and TransformerLens'
hook API works."""

from pathlib import Path

import pytest
import torch

import memviz
from memviz.__main__ import hook_table
from memviz.registry import get_family
from memviz.running import generic_hook_name
from tests.conftest import FAMILY_CONFIGS, random_ids, scrambled, small_model

DOC = Path(__file__).resolve().parent.parent / "docs" / "hooks.md"


def test_every_family_built_from_a_config_declares_its_tiny_config():
    assert set(FAMILY_CONFIGS) == {f.name for f in memviz.families() if f.from_config}


def test_the_hook_table_in_the_docs_is_the_one_the_families_declare():
    assert hook_table(memviz.families()) in DOC.read_text(), "docs/hooks.md is stale: python -m memviz hooks"


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_a_family_declares_exactly_the_hooks_its_model_has(family):
    model = small_model(family, **FAMILY_CONFIGS[family])
    assert {generic_hook_name(name) for name in model.hook_dict} == set(get_family(family).hook_docs)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_run_with_cache_gives_batch_pos_layouts(family):
    model = small_model(family, **FAMILY_CONFIGS[family])
    ids = random_ids(20).repeat(2, 1)
    logits, cache = model.run_with_cache(ids)
    assert isinstance(cache, dict) and set(cache) == set(model.hook_dict)
    torch.testing.assert_close(logits, model(ids))
    for name, value in cache.items():
        assert value.shape[:2] == (2, 20), (name, tuple(value.shape))
    if "blocks.0.attn.hook_q" in cache:  # not in titans-pytorch's own transformer (the titans_pytorch adapter)
        assert cache["blocks.0.attn.hook_q"].shape == (2, 20, model.cfg.n_heads, model.cfg.d_head)


def test_run_with_hooks_can_ablate_a_head():
    model = scrambled(small_model("sliding_window", window=8))
    ids = random_ids(16)
    seen = []

    def zero_head_0(z, hook):
        seen.append(hook.name)
        z[:, :, 0] = 0.0
        return z

    clean = model(ids)
    ablated = model.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", zero_head_0)])
    assert seen == ["blocks.1.attn.hook_z"]
    assert (ablated - clean).abs().max() > 1e-3
    torch.testing.assert_close(model(ids), clean)  # hooks are removed afterwards


def test_a_string_runs_through_the_tokenizer_as_transformer_lens_users_expect():
    model = scrambled(small_model("infini", segment_len=8))
    text = "Mary went to the office."
    ids = torch.tensor([model.tokenizer.encode(text)])
    logits, cache = model.run_with_cache(text)
    expected, expected_cache = model.run_with_cache(ids)
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)
    torch.testing.assert_close(
        cache["blocks.0.attn.hook_mem_out"], expected_cache["blocks.0.attn.hook_mem_out"], atol=0, rtol=0
    )
    hooked = model.run_with_hooks(text, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: z * 0)])
    assert hooked.shape == expected.shape and not torch.equal(hooked, expected)
    with pytest.raises(TypeError, match="not bytes"):
        model(text.encode())


def test_hooks_given_as_a_generator_all_run():
    model = small_model("sliding_window", window=8)
    seen = []
    names = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    model.run_with_hooks("hello there", fwd_hooks=((n, lambda value, hook: seen.append(hook.name)) for n in names))
    assert seen == names
