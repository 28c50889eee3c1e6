"""reward_model:PATH: a tiny randomly initialised sequence-classification Llama, saved to a
directory, scores prompt + completion batched exactly as one at a time, combines with a
verifier by weight, is loaded once, and bad directories are clear ConfigErrors."""

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

from postrl.errors import ConfigError
from postrl.models.loading import smollm2_dir
from postrl.rewards import RewardModel, Scorer, load_reward, reward_name
from postrl.rewards import reward_model as reward_model_module
from postrl.tasks.chat import build_prompt


def tiny_config(tokenizer, num_labels=1, **overrides) -> LlamaConfig:
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, num_labels=num_labels,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=None, **overrides)


def save(directory, model, tokenizer):
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer without a pad token (its pad is its end-of-sequence token, which
    also ends every chat turn of a prompt: the case that breaks careless padding)."""
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    tokenizer.pad_token = None
    return tokenizer


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(tiny_config(tokenizer))
    return save(tmp_path_factory.mktemp("rm") / "tiny-rm", model, tokenizer)


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(reward_model_module, "_LOADED", {})


def samples(tokenizer):
    questions = ["What is 2 + 2?", "Name a colour.", "Say hi", "Count to three, slowly."]
    completions = ["4", "The sky is often blue, and so is the sea.", "", "one, two, three"]
    prompts = [build_prompt(tokenizer, question) for question in questions]
    return prompts + prompts[:1], completions + ["Four, of course!"]


def direct_logit(model, tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()  # one text: no padding at all


def test_the_reward_is_the_models_own_logit_and_batching_changes_nothing(rm_dir, tokenizer):
    prompts, completions = samples(tokenizer)
    assert tokenizer.eos_token in prompts[0]  # the pad id the model will use is in the text
    assert AutoTokenizer.from_pretrained(rm_dir).pad_token is None
    reward = load_reward(f"reward_model:{rm_dir}")
    assert isinstance(reward, RewardModel) and not reward.model.training
    assert reward.tokenizer.pad_token_id == tokenizer.eos_token_id  # no pad token: eos pads
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    expected = [direct_logit(model, tokenizer, prompt + completion)
                for prompt, completion in zip(prompts, completions, strict=True)]
    assert len(set(expected)) == len(expected)

    reward.batch_size = 3  # 5 texts of different lengths: two batches, padded on the right
    batched = reward(prompts, completions, answer=["4"] * 5)
    reward.batch_size = 1
    alone = reward(prompts, completions)
    assert all(isinstance(value, float) for value in batched)
    assert batched == pytest.approx(expected, abs=1e-5)
    assert batched == pytest.approx(alone, abs=1e-5)


def test_long_texts_lose_their_beginning(rm_dir, tokenizer):
    prompts, completions = samples(tokenizer)
    reward = load_reward(f"reward_model:{rm_dir}")
    reward.max_length = 12
    ids = tokenizer(prompts[1] + completions[1], add_special_tokens=False)["input_ids"]
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    with torch.no_grad():
        kept = model(input_ids=torch.tensor([ids[-12:]])).logits[0, 0].item()
    assert reward(prompts[:2], completions[:2])[1] == pytest.approx(kept, abs=1e-5)


def test_weighted_with_a_verifier_in_the_scorer(rm_dir, tokenizer):
    prompts, completions = samples(tokenizer)
    answers = ["4", "blue", "hi", "3", "4"]
    scorer = Scorer([(f"reward_model:{rm_dir}", 0.5), ("math_answer", 2.0)])
    assert scorer.names == ["tiny-rm", "math_answer"] == [
        reward_name(f"reward_model:{rm_dir}"), "math_answer"]
    scored = scorer.score(prompts, completions, {"answer": answers})
    rm = load_reward(f"reward_model:{rm_dir}")(prompts, completions)
    verdicts = scored.per_function["math_answer"]
    assert verdicts == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert scored.per_function["tiny-rm"] == pytest.approx(rm, abs=1e-6)
    expected = [0.5 * r + 2.0 * v for r, v in zip(rm, verdicts, strict=True)]
    assert scored.total == pytest.approx(expected)


def test_the_model_is_loaded_once(rm_dir, tokenizer, monkeypatch):
    loads = []
    original = AutoModelForSequenceClassification.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        loads.append(args[0])
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained",
                        classmethod(counting))
    first = load_reward(f"reward_model:{rm_dir}")
    model = first.model
    prompts, completions = samples(tokenizer)
    first(prompts, completions)
    first(prompts, completions)
    assert load_reward(f"reward_model:{rm_dir}/") is first  # the same directory, spelt apart
    Scorer([(f"reward_model:{rm_dir}", 1.0)]).score(prompts, completions, {})
    assert first.model is model and len(loads) == 1


def test_the_device_can_be_set(rm_dir, tokenizer):
    reward = load_reward(f"reward_model:{rm_dir}")
    assert reward.device == "auto"
    Scorer([(f"reward_model:{rm_dir}", 1.0), ("math_answer", 1.0)]).place("cpu")  # the trainer's
    assert reward.device == "cpu"
    prompts, completions = samples(tokenizer)
    assert len(reward(prompts, completions)) == 5
    assert next(reward.model.parameters()).device == torch.device("cpu")


def test_a_missing_directory_is_named(tmp_path):
    missing = tmp_path / "no_rm"
    with pytest.raises(ConfigError, match="no such directory") as error:
        load_reward(f"reward_model:{missing}")
    assert f"reward_model:{missing}" in str(error.value) and str(missing) in str(error.value)
    with pytest.raises(ConfigError, match="expected reward_model:PATH"):
        load_reward("reward_model:")


def test_two_labels_are_refused(tmp_path, tokenizer):
    model = LlamaForSequenceClassification(tiny_config(tokenizer, num_labels=2))
    directory = save(tmp_path / "two", model, tokenizer)
    with pytest.raises(ConfigError, match="num_labels=2") as error:
        load_reward(f"reward_model:{directory}")
    assert str(directory) in str(error.value)


def test_a_causal_lm_is_not_a_reward_model(tmp_path, tokenizer):
    directory = save(tmp_path / "lm", LlamaForCausalLM(tiny_config(tokenizer)), tokenizer)
    with pytest.raises(ConfigError, match="not a sequence-classification model") as error:
        load_reward(f"reward_model:{directory}")
    assert "LlamaForCausalLM" in str(error.value) and str(directory) in str(error.value)


def test_unloadable_weights_are_a_config_error(tmp_path, tokenizer):
    model = LlamaForSequenceClassification(tiny_config(tokenizer))
    directory = save(tmp_path / "broken", model, tokenizer)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="transformers could not load it") as error:
        load_reward(f"reward_model:{directory}")
    assert str(directory) in str(error.value)
