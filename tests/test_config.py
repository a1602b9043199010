import copy
import math

import pytest
import torch

import memviz
from memviz import ConfigError, ModelConfig, build_model
from tests.conftest import FAMILY_CONFIGS, SMALL


def test_config_round_trips_through_json():
    cfg = ModelConfig(family="sliding_window", d_model=48, n_heads=3, window=64, memory={}, name="x")
    again = ModelConfig.from_json(cfg.to_json())
    assert again == cfg
    assert again.d_head == 16 and again.d_mlp == 128


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"d_model": 0}, "d_model"),
        ({"n_heads": -1}, "n_heads"),
        ({"window": 0}, "window"),
        ({"d_head": 7}, "even"),
        ({"memory": []}, "memory"),
        ({"colour": "red"}, "unknown config fields"),
        ({"embed_scale": 0}, "embed_scale"),
        ({"embed_scale": "big"}, "embed_scale"),
        ({"init": "xavier"}, "init"),
    ],
)
def test_bad_config_fields_raise_config_error(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({"family": "transformer", **fields})


def test_unknown_family_and_bad_json():
    with pytest.raises(ConfigError, match="unknown model family 'nope'"):
        build_model(ModelConfig(family="nope"))
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json("{")
    with pytest.raises(ConfigError, match="'family' must name a model family"):
        ModelConfig.from_dict({"d_model": 64})
    with pytest.raises(ConfigError, match="over memviz's cap .* nothing was allocated"):
        ModelConfig(family="transformer", n_layers=1_000_000)
    with pytest.raises(ConfigError, match="over memviz's cap"):
        ModelConfig(family="transformer", d_model=65536, n_heads=64)
    for field, bad in (("rope_base", -1.0), ("norm_eps", float("nan")), ("rope_base", "10000")):
        with pytest.raises(ConfigError, match=f"'{field}' must be a positive finite number"):
            ModelConfig(family="transformer", **{field: bad})
    with pytest.raises(ConfigError, match="'sliding_window' family needs attention"):
        build_model(ModelConfig(family="sliding_window"))
    with pytest.raises(ConfigError, match="'transformer' family is full causal"):
        build_model(ModelConfig(family="transformer", attention={"kind": "window", "span": 8}))
    with pytest.raises(ConfigError, match="unknown sliding_window memory options"):
        build_model(ModelConfig(family="sliding_window", window=8, memory={"slots": 4}))


@pytest.mark.parametrize("family, window", [("transformer", None), ("sliding_window", 16)])
def test_fan_in_init_and_embed_scale(family, window):
    """fan_in draws each weight with std 1/sqrt(fan_in) (output projections / sqrt(2 L)),
    and embed_scale multiplies the embedding that enters the residual stream."""
    torch.manual_seed(0)
    cfg = ModelConfig(family=family, window=window, d_model=64, n_layers=2, init="fan_in", embed_scale=8.0)
    model = build_model(cfg)
    block = model.blocks[0]
    assert abs(model.embed.weight.std().item() - 64**-0.5) < 0.005
    assert abs(block.attn.W_Q.weight.std().item() - 64**-0.5) < 0.01
    assert abs(block.mlp.W_down.weight.std().item() - cfg.d_mlp**-0.5 / 2) < 0.01
    tokens = torch.tensor([[1, 2, 3]])
    _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(cache["hook_embed"], model.embed.weight[tokens] * 8.0)
    torch.manual_seed(0)
    gpt2 = build_model(cfg.replace(init="gpt2", embed_scale=1.0))
    assert abs(gpt2.blocks[0].attn.W_Q.weight.std().item() - 0.02) < 0.002


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_building_a_model_leaves_the_callers_config_as_given(family):
    cfg = ModelConfig(family=family, **{**SMALL, **copy.deepcopy(FAMILY_CONFIGS[family])})
    before = cfg.to_dict()
    model = build_model(cfg)
    assert cfg.to_dict() == before and model.cfg is not cfg
    assert build_model(ModelConfig.from_dict(model.cfg.to_dict())).cfg.to_dict() == model.cfg.to_dict()


CONFIG_CASES = {
    "negative d_model": (dict(d_model=-4), "d_model"),
    "odd d_head": (dict(d_model=30, n_heads=2), "d_head"),
    "string n_layers": (dict(n_layers="four"), "n_layers"),
    "NaN rope_base": (dict(rope_base=math.nan), "rope_base"),
    "negative norm_eps": (dict(norm_eps=-1e-5), "norm_eps"),
    "window of zero": (dict(attention={"kind": "window", "span": 0}), "span"),
    "unknown attention kind": (dict(attention={"kind": "sideways", "span": 8}), "sideways"),
    "a window of 1e30 tokens": (
        dict(attention={"kind": "window", "span": 10**30}),
        "window attention needs a span, a whole number of tokens from 1 to 16,777,216, got 1" + "0" * 30,
    ),
    "a segment of a billion tokens": (
        dict(segment_len=10**9),
        "config field 'segment_len' must be a whole number of tokens from 1 to 16,777,216 or null, got 1000000000",
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_a_nonsense_config_is_one_config_error_naming_the_field(case):
    fields, named = CONFIG_CASES[case]
    with pytest.raises(ConfigError, match=named):
        memviz.build_model(ModelConfig(family="sliding_window", **{"vocab_size": 259, **fields}))


@pytest.mark.parametrize("field, value", [("tie_embeddings", "no"), ("tie_embeddings", 1), ("name", 5)])
def test_a_model_config_boolean_or_name_of_the_wrong_type_names_the_field(field, value):
    with pytest.raises(memviz.ConfigError, match=f"'{field}' must be"):
        memviz.ModelConfig(family="transformer", **{field: value})
