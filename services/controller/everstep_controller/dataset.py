"""Prompt datasets: JSONL rows with a prompt and a reference answer, tokenized without torch."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptRow:
    index: int  # position in the file, stable across restarts
    prompt: str
    answer: str
    prompt_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadedDataset:
    rows: list[PromptRow]
    num_skipped: int  # rows without the prompt or answer field, reported and left out


def load_tokenizer(model_path: str) -> Tokenizer:
    path = Path(model_path) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"model_path {model_path!r} has no tokenizer.json")
    return Tokenizer.from_file(str(path))


def load_prompt_rows(path: str, tokenizer: Tokenizer, *, prompt_field: str, answer_field: str) -> LoadedDataset:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"dataset file {path!r} does not exist")
    rows: list[PromptRow] = []
    skipped = 0
    with file.open() as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, answer = row[prompt_field], row[answer_field]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                skipped += 1
                log.warning("dataset %s line %d skipped: %s", path, line_number, e)
                continue
            ids = tuple(tokenizer.encode(str(prompt)).ids)
            rows.append(PromptRow(line_number - 1, str(prompt), str(answer), ids))
    if not rows:
        raise ValueError(f"dataset {path!r} has no usable rows ({skipped} skipped)")
    return LoadedDataset(rows, skipped)
