"""Fixtures of the reward tests: a tiny reward model built on the spot."""

from __future__ import annotations

from pathlib import Path

import pytest

REWARD_WORDS = ["<pad>", "<s>", "</s>", "<unk>", "the", "answer", "is", "\\boxed{", "}", "good", "bad", "so",
                "<think>", "</think>"] + [str(i) for i in range(20)]


def make_tiny_reward_model(out: Path, *, seed: int = 0) -> Path:
    """A random LlamaForSequenceClassification (num_labels=1) + word-level tokenizer, HF format."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(REWARD_WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(out)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, num_labels=1)
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_reward_model(tmp_path_factory.mktemp("tiny-reward-model"))
