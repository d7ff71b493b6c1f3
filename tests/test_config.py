"""The configs (`d3d.config`): JSON that does not fit a config — missing, unknown or wrong-typed
fields — and non-finite sampling parameters are ConfigErrors naming the field, never a TypeError."""

from __future__ import annotations

import math

import pytest

from conftest import tiny_config
from d3d.config import ConfigError, DrafterConfig, GenerationConfig, ModelConfig, SamplingConfig


def drafter_document(**changes) -> dict:
    document = DrafterConfig(model=tiny_config(), block_size=4, target_layers=[0]).to_dict()
    return {**document, **changes}


def model_document(**changes) -> dict:
    return {**tiny_config().to_dict(), **changes}


@pytest.mark.parametrize("document, fragment", [
    ({k: v for k, v in drafter_document().items() if k != "model"}, "DrafterConfig: missing fields ['model']"),
    (drafter_document(blok_size=4), "DrafterConfig: unknown fields ['blok_size']"),
    (drafter_document(block_size="4"), 'DrafterConfig.block_size: expected int, got "4"'),
    (drafter_document(block_size=4.5), "DrafterConfig.block_size: expected int, got 4.5"),
    (drafter_document(block_size=True), "DrafterConfig.block_size: expected int, got true"),
    (drafter_document(shared_embeddings="no"), "DrafterConfig.shared_embeddings: expected bool"),
    (drafter_document(target_layers=["0"]), "DrafterConfig.target_layers: expected list[int]"),
    (drafter_document(labels="sideways"), 'DrafterConfig.labels: expected "shifted" or "unshifted"'),
    (drafter_document(model=[1, 2]), "DrafterConfig.model: expected ModelConfig, got [1, 2]"),
    (drafter_document(model={k: v for k, v in model_document().items() if k != "hidden_size"}),
     "ModelConfig: missing fields ['hidden_size']"),
    (drafter_document(model=model_document(hiden_size=32)), "ModelConfig: unknown fields ['hiden_size']"),
    (drafter_document(model=model_document(vocab_size="64")), 'ModelConfig.vocab_size: expected int, got "64"'),
    (drafter_document(model=model_document(rope_scaling=3)), "ModelConfig.rope_scaling: expected dict"),
    (drafter_document(model=model_document(family="gpt2")), "ModelConfig.family: expected"),
    ([drafter_document()], "DrafterConfig: expected a JSON object, got list"),
])
def test_from_dict_refuses_what_does_not_fit(document, fragment):
    """Each bad document raises a ConfigError whose message names the config, the field and the value."""
    with pytest.raises(ConfigError) as error:
        DrafterConfig.from_dict(document)
    assert fragment in str(error.value)


def test_from_dict_accepts_json_spellings():
    """What JSON round trips give back is accepted: an int for a float field, null for an optional one."""
    config = DrafterConfig.from_dict(drafter_document(model=model_document(rope_theta=10000, rope_scaling=None)))
    assert config.model.rope_theta == 10000 and config.model.rope_scaling is None
    assert GenerationConfig.from_dict({"sampling": {"temperature": 1, "seed": None}}).sampling.temperature == 1
    assert SamplingConfig.from_dict({"seed": 3}).seed == 3


@pytest.mark.parametrize("scaling, fragment", [({"rope_type": "yarn", "factor": 2.0}, "unsupported rope scaling 'yarn'"),
                                               ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
                                               ({"type": "linear"}, "['factor']")])
def test_rope_scaling_the_decoder_cannot_apply_is_refused(scaling, fragment):
    """An unknown RoPE scaling, or one missing the keys it reads, fails in the config (not as a
    KeyError when the decoder is built)."""
    with pytest.raises(ConfigError, match="rope") as error:
        tiny_config(rope_scaling=scaling)
    assert fragment in str(error.value)
    tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0})  # a complete one is fine


@pytest.mark.parametrize("values, fragment", [(dict(temperature=math.inf), "temperature must be a finite number"),
                                              (dict(temperature=math.nan), "temperature must be a finite number"),
                                              (dict(temperature=-0.5), "temperature"),
                                              (dict(top_p=math.nan), "top_p"),
                                              (dict(top_p=math.inf), "top_p"),
                                              (dict(top_k=-1), "top_k")])
def test_sampling_parameters_must_be_finite_and_in_range(values, fragment):
    with pytest.raises(ConfigError, match=fragment):
        SamplingConfig(**values)
    assert SamplingConfig(temperature=1e300).temperature == 1e300  # large but finite is a valid temperature


def test_model_config_refuses_non_positive_norm_epsilon():
    with pytest.raises(ConfigError, match="rms_norm_eps"):
        ModelConfig(**{**tiny_config().to_dict(), "rms_norm_eps": -1e-6})
