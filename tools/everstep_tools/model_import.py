"""`everstep model import`: a GGUF file, or any directory transformers loads, as a plain Hugging Face directory.

The directory written holds what every everstep service reads: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json (with the model's `chat_template`) and generation_config.json
(with every end-of-sequence id). A GGUF file is dequantized by transformers (`gguf_file=`, needs the
`gguf` package); transformers refuses to `save_pretrained` a model loaded that way, so the weights are
copied into a fresh model built from the same config, which saves normally.

End-of-sequence ids: the config's and generation config's, the tokenizer's EOS token, and every
special token of the vocabulary that ends a turn or a document in the common chat formats
(`END_OF_TURN_TOKENS`): an instruct model ends its answer with `<|im_end|>` but may also emit
`<|endoftext|>`, and an engine that stops on only one of them runs on to max_new_tokens.

    python -m everstep_tools.model_import SOURCE --out DIR [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["END_OF_TURN_TOKENS", "ImportedModel", "import_model", "main"]

END_OF_TURN_TOKENS: tuple[str, ...] = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>", "</s>",
    "<|eom_id|>",
)
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ImportedModel:
    out_dir: Path
    model_type: str
    num_parameters: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool


def _split_source(source: Path) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) of SOURCE; ValueError when it is neither."""
    if source.is_file():
        if source.suffix.lower() != ".gguf":
            raise ValueError(f"SOURCE {source} is a file but not a .gguf file; give a GGUF file or a Hugging "
                             "Face model directory")
        return source.parent, source.name
    if source.is_dir():
        if not (source / "config.json").is_file():
            raise ValueError(f"SOURCE {source} is a directory without config.json, so not one transformers "
                             "loads")
        return source, None
    raise FileNotFoundError(f"SOURCE {source} does not exist")


def eos_token_ids(tokenizer, *candidates: int | list[int] | None) -> tuple[int, ...]:
    """Every end-of-sequence id, in a stable order: the given ids first, then the tokenizer's."""
    ids: list[int] = []
    for value in candidates:
        ids.extend([value] if isinstance(value, int) else list(value or ()))
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    special = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()
                                                    if t.special}
    for token in END_OF_TURN_TOKENS:
        if token in special:
            ids.append(int(tokenizer.convert_tokens_to_ids(token)))
    return tuple(dict.fromkeys(ids))


def import_model(source: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> ImportedModel:
    """Writes SOURCE (a .gguf file or a transformers directory) to `out_dir` as a plain HF directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    directory, gguf_file = _split_source(Path(source))
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty; remove it or choose another folder")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    torch_dtype = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(directory, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)
    if gguf_file:  # save_pretrained refuses a GGUF-loaded model: copy its weights into a fresh one
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"the GGUF weights do not fit the model built from its config: missing {missing}, "
                               f"unexpected {unexpected}")
        if config.tie_word_embeddings:
            model.tie_weights()
        del loaded
    else:
        model = loaded
    model = model.to(torch_dtype)
    model.config.dtype = dtype

    if not gguf_file and (directory / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(directory)
    else:  # GGUF files carry none
        generation = GenerationConfig.from_model_config(config)
    eos = eos_token_ids(tokenizer, generation.eos_token_id, config.eos_token_id)
    generation.eos_token_id = list(eos) if len(eos) > 1 else eos[0] if eos else None
    if generation.pad_token_id is None and tokenizer.pad_token_id is not None:
        generation.pad_token_id = int(tokenizer.pad_token_id)
    if generation.bos_token_id is None and tokenizer.bos_token_id is not None:
        generation.bos_token_id = int(tokenizer.bos_token_id)
    model.generation_config = generation

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _chat_template_into_tokenizer_config(out, tokenizer.chat_template)
    imported = ImportedModel(out, config.model_type, sum(p.numel() for p in model.parameters()), eos,
                             bool(tokenizer.chat_template))
    (out / "everstep_import.json").write_text(json.dumps({
        "source": str(Path(source).resolve()), "dtype": dtype, "model_type": imported.model_type,
        "num_parameters": imported.num_parameters, "eos_token_ids": list(eos)}, indent=1) + "\n")
    return imported


def _chat_template_into_tokenizer_config(out: Path, template: str | dict | None) -> None:
    """Recent transformers write the template to chat_template.jinja; everstep reads tokenizer_config.json's
    `chat_template` (as transformers also does), so it is put there, and the separate file removed."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if template:
        config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    jinja = out / "chat_template.jinja"
    if template and jinja.exists():
        jinja.unlink()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="everstep model import", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a .gguf file, or a Hugging Face model directory")
    parser.add_argument("--out", required=True, help="folder to write (must be new or empty)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the saved weights")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        imported = import_model(args.source, args.out, dtype=args.dtype)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        sys.exit(f"everstep model import: {e}")
    print(json.dumps({"out": str(imported.out_dir), "model_type": imported.model_type,
                      "num_parameters": imported.num_parameters, "eos_token_ids": list(imported.eos_token_ids),
                      "chat_template": imported.has_chat_template}))


if __name__ == "__main__":
    main()
