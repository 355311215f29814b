"""The demo tokenizer survives a save / AutoTokenizer round trip and round-trips every token."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from everstep_tools.demo.evaluation import boxed_answer
from everstep_tools.demo.task import TaskConfig, generate_problems, solution_text
from everstep_tools.demo.tokenizer import SPECIAL_TOKENS, save_tokenizer


def test_auto_tokenizer_round_trips_every_token_and_text(tmp_path):
    config = TaskConfig()
    save_tokenizer(config.words(), tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(config.words())
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    for word in config.words():
        ids = tokenizer.encode(word, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] != tokenizer.unk_token_id, word
        assert tokenizer.decode(ids) == word
    for problem in generate_problems(50, seed=1, distinct=False):
        text = f"{problem.prompt} {solution_text(problem)}"
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id  # prompts get BOS whoever tokenizes them
        assert tokenizer.unk_token_id not in ids
        assert len(ids) == 1 + len(text.split())  # one token per word
        decoded = tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True)
        assert decoded == text
        assert boxed_answer(decoded) == str(problem.answer)


def test_unknown_words_map_to_unk(tmp_path):
    save_tokenizer(TaskConfig(max_value=9).words(), tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.encode("3 + 12", add_special_tokens=False)[-1] == tokenizer.unk_token_id
