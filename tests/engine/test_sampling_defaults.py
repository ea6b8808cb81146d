"""What a served turn samples with where its request is silent: the server's settings, else the model's
own generation config (all of its values or none), else the chat defaults."""
import pytest
from transformers import GenerationConfig

from app.engine.errors import InvalidSamplingParams
from app.engine.sampling_defaults import CHAT_DEFAULTS, model_generation, served_defaults
from app.session_restore import checked_sampling
from app.settings import Settings

NEUTRAL = {"min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


@pytest.fixture(autouse=True)
def served_as_shipped(monkeypatch):
    """Without the suite's greedy setting (tests/conftest.py): the defaults as a server ships them."""
    monkeypatch.delenv("RKV_DEFAULT_TEMPERATURE", raising=False)
    monkeypatch.delenv("RKV_DEFAULT_REPETITION_PENALTY", raising=False)


def test_a_model_without_a_generation_config_gets_the_chat_defaults():
    assert model_generation(None) == {}
    assert model_generation(GenerationConfig(bos_token_id=1, eos_token_id=2)) == {}  # what a GGUF gives
    assert served_defaults(Settings(), {}) == {**NEUTRAL, **CHAT_DEFAULTS}


def test_the_models_own_values_replace_the_chat_defaults_whole():
    config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    values = model_generation(config)
    assert values == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    # min_p is not among them: the model's authors did not ask for it, so it is off, not the chat default.
    assert served_defaults(Settings(), values) == {**values, "min_p": 0.0, "frequency_penalty": 0.0,
                                                   "presence_penalty": 0.0}
    assert model_generation(GenerationConfig(do_sample=False))["temperature"] == 0.0


def test_server_settings_win_and_are_checked_at_start(monkeypatch):
    monkeypatch.setenv("RKV_DEFAULT_TEMPERATURE", "0.3")
    monkeypatch.setenv("RKV_DEFAULT_PRESENCE_PENALTY", "0.5")
    defaults = served_defaults(Settings(), {"temperature": 0.7, "top_p": 0.8})
    assert defaults["temperature"] == 0.3 and defaults["presence_penalty"] == 0.5 and defaults["top_p"] == 0.8
    monkeypatch.setenv("RKV_DEFAULT_MIN_P", "3")
    with pytest.raises(InvalidSamplingParams, match="min_p"):
        served_defaults(Settings(), {})


def test_a_request_overrides_each_default_it_sends_and_keeps_the_rest():
    defaults = {**NEUTRAL, **CHAT_DEFAULTS}
    params = checked_sampling({"temperature": 0, "top_k": None, "presence_penalty": 1.5, "seed": 3}, defaults)
    assert params.greedy and params.presence_penalty == 1.5 and params.seed == 3
    assert params.top_k == CHAT_DEFAULTS["top_k"] and params.top_p == CHAT_DEFAULTS["top_p"]
    assert checked_sampling(None, defaults).shaping() == defaults
    assert checked_sampling({}, None).plain  # no defaults: the engine's own greedy decoding
