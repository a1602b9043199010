import pytest

from memviz import ConfigError, ModelConfig, build_model


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
    with pytest.raises(ConfigError, match="needs config.window"):
        build_model(ModelConfig(family="sliding_window"))
    with pytest.raises(ConfigError, match="unknown sliding_window memory options"):
        build_model(ModelConfig(family="sliding_window", window=8, memory={"slots": 4}))
