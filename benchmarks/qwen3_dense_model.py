"""A random Qwen3 dense checkpoint for `benchmarks.rollout_throughput`:
`python -m benchmarks.qwen3_dense_model --tokenizer outputs/smollm2-135m-instruct --out outputs/qwen3-dense-80m`.

No Qwen3 dense checkpoint ships with the project, so this builds one from transformers' `Qwen3Config` with
Qwen3-0.6B's shape scaled down by two in width and depth: hidden 1024 -> 512, intermediate 3072 -> 1536,
28 -> 14 layers, 16 -> 8 query heads and 8 -> 4 key/value heads of head_dim 128 (as every Qwen3 size has),
tied embeddings, rope_theta 1e6, RMSNorm eps 1e-6. The vocabulary and the tokenizer (chat template
included) are copied from `--tokenizer`, an existing model directory; with SmolLM2's 49152 tokens the model
has about 80M parameters, 25M of them in the embedding. The weights are transformers' random initialisation
(seeded), in float32: sampled at T = 1 its outputs are near-uniform over the vocabulary, so it rarely emits
EOS and every sequence runs to max_new_tokens. That makes it the benchmark's case without a length tail:
its ratio measures the cost of a decode step alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Qwen3-0.6B's config.json, halved in width and depth (see the module docstring).
QWEN3_SCALED_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=14, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                          max_position_embeddings=4096, tie_word_embeddings=True)


def build(tokenizer_dir: Path, out: Path, *, seed: int = 0, num_layers: int | None = None) -> Path:
    """Write a random Qwen3ForCausalLM of QWEN3_SCALED_SHAPE with `tokenizer_dir`'s tokenizer to `out`."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    if not (tokenizer_dir / "tokenizer_config.json").exists():
        raise ValueError(f"--tokenizer: {tokenizer_dir} has no tokenizer_config.json (pass a model directory, "
                         "e.g. outputs/smollm2-135m-instruct from `make real-model`)")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"--tokenizer: the tokenizer of {tokenizer_dir} has no eos_token")
    shape = dict(QWEN3_SCALED_SHAPE)
    if num_layers is not None:
        shape["num_hidden_layers"] = num_layers
    config = Qwen3Config(**shape, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=eos,
                         pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    num_parameters = sum(p.numel() for p in model.parameters())
    (out / "build.json").write_text(json.dumps({
        "built_by": "python -m benchmarks.qwen3_dense_model", "tokenizer": str(tokenizer_dir), "seed": seed,
        "num_parameters": num_parameters, "shape": shape, "vocab_size": config.vocab_size,
    }, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.qwen3_dense_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="model directory whose tokenizer to use")
    p.add_argument("--out", type=Path, required=True, help="directory to write the model to")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=None,
                   help=f"decoder layers (default {QWEN3_SCALED_SHAPE['num_hidden_layers']}); tests use fewer")
    args = p.parse_args(argv)
    if args.num_layers is not None and args.num_layers < 1:
        p.error("--num-layers must be >= 1")
    try:
        out = build(args.tokenizer, args.out, seed=args.seed, num_layers=args.num_layers)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(json.loads((out / "build.json").read_text())["num_parameters"], "parameters written to", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
