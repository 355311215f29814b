"""A word-level fast tokenizer for the demo task: one token per number or symbol.

Built on ``tokenizers`` (WordLevel + WhitespaceSplit) and saved as ``tokenizer.json`` through
``PreTrainedTokenizerFast``, so ``AutoTokenizer`` loads it back as the same fast tokenizer
(a Llama config never routes it through a slow tokenizer class that might drop characters).
Decoding joins words with single spaces, which is also how the task writes its text, so
encode -> decode round-trips exactly.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

__all__ = ["SPECIAL_TOKENS", "build_tokenizer", "save_tokenizer"]

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
"""Ids 0..3, in this order (``LlamaConfig`` gets pad=0, bos=1, eos=2)."""


def build_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A fast tokenizer whose vocabulary is the special tokens followed by ``words``."""
    if len(set(words)) != len(words) or set(words) & set(SPECIAL_TOKENS):
        raise ValueError("words must be distinct and must not contain special tokens")
    if any(not w or any(c.isspace() for c in w) for w in words):
        raise ValueError("words must be non-empty and contain no whitespace")
    vocab = {w: i for i, w in enumerate([*SPECIAL_TOKENS, *words])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    # Prompts start with BOS (as in training) whoever tokenizes them: tokenizer(prompt) adds it.
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", clean_up_tokenization_spaces=False, model_max_length=2048,
    )


def save_tokenizer(words: list[str], out: Path) -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer(words)
    tokenizer.save_pretrained(out)
    return tokenizer
