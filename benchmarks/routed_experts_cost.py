"""What routing replay costs the torch engine: `python -m benchmarks.routed_experts_cost [--model DIR] ...`.

Without --model, a tiny random Qwen3-MoE is built in a temporary directory (the tests' tiny MoE: 2 layers,
hidden 64, 8 experts, top-2; `--hidden`/`--layers` make it larger). The same workload (`--num-prompts`
random prompts of 4..`--max-prompt` tokens, temperature 1, `--max-new-tokens` each, `--max-running`
decoded together, fixed seeds so both settings generate the same tokens) runs with and without
`return_routed_experts`, alternating, `--repeats` times; the figures are medians of decode throughput
(generated tokens per second). The native executor records every MoE forward pass's routes either way;
what the option adds is the per-pass device-to-host copy of them and the per-sequence bookkeeping.

Also reported: the bytes `Sequence.routed_experts` takes per position (moe layers x top_k, uint8), for the
model measured and, computed, for Qwen3-30B-A3B (48 MoE layers, top-8). The last line of stdout is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

QWEN3_30B_A3B = {"moe_layers": 48, "top_k": 8}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.routed_experts_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="an MoE model directory (default: a tiny random one)")
    p.add_argument("--hidden", type=int, default=64, help="the tiny model's hidden size")
    p.add_argument("--layers", type=int, default=2, help="the tiny model's layers (all sparse)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


def tiny_moe(out: Path, *, hidden: int, layers: int) -> Path:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                            max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=hidden, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], bos_token_id=1, eos_token_id=2, pad_token_id=0,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(512)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2", pad_token="w0",
                            unk_token="w3").save_pretrained(out)
    return out


def run(engine, prompts: list[list[int]], *, routed: bool, max_new_tokens: int, tag: str) -> dict:
    from everstep_rollout.sequence import GenerationRequest, SamplingOptions

    requests = [GenerationRequest(id=f"{tag}-{i}", prompt_ids=p, sampling=SamplingOptions(
        temperature=1.0, max_new_tokens=max_new_tokens, seed=1000 + i, return_routed_experts=routed))
        for i, p in enumerate(prompts)]
    start = time.perf_counter()
    engine.add(requests)
    tokens = route_bytes = 0
    decode_seconds = 0.0
    while engine.has_work:
        for r in engine.step():
            tokens += len(r.output_ids)
            route_bytes += len(r.routed_experts)
        decode_seconds += engine.last_step.step_seconds
    return {"routed": routed, "tokens": tokens, "seconds": time.perf_counter() - start,
            "tokens_per_s": tokens / decode_seconds, "route_bytes": route_bytes}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from everstep_rollout.config import EngineConfig
    from everstep_rollout.engine import Engine

    torch.set_num_threads(args.num_threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tiny_moe(Path(tmp) / "moe", hidden=args.hidden, layers=args.layers)
        engine = Engine(model_dir, EngineConfig(max_running=args.max_running, device=args.device,
                                                max_seq_len=args.max_prompt + args.max_new_tokens + 1))
        shape = engine.routing_shape
        if shape is None:
            print(f"{model_dir} is not an MoE model on the native executor", file=sys.stderr)
            return 2
        rng = random.Random(0)
        vocab = engine.vocab_size
        prompts = [[1] + [rng.randrange(3, vocab) for _ in range(rng.randrange(3, args.max_prompt))]
                   for _ in range(args.num_prompts)]
        run(engine, prompts[:4], routed=True, max_new_tokens=8, tag="warm")
        runs = []
        for repeat in range(args.repeats):
            for routed in (False, True):
                r = run(engine, prompts, routed=routed, max_new_tokens=args.max_new_tokens, tag=f"{repeat}-{routed}")
                print(json.dumps(r), file=sys.stderr)
                runs.append(r)
    off = statistics.median(r["tokens_per_s"] for r in runs if not r["routed"])
    on = statistics.median(r["tokens_per_s"] for r in runs if r["routed"])
    per_position = len(shape.moe_layers) * shape.top_k
    report = {
        "model": str(args.model or f"tiny qwen3_moe (hidden {args.hidden}, {args.layers} layers, 8 experts, top-2)"),
        "moe_layers": len(shape.moe_layers), "top_k": shape.top_k, "bytes_per_position": per_position,
        "qwen3_30b_a3b_bytes_per_position": QWEN3_30B_A3B["moe_layers"] * QWEN3_30B_A3B["top_k"],
        "tokens_per_s_without": round(off, 1), "tokens_per_s_with": round(on, 1), "ratio": round(on / off, 3),
        "runs": runs, "settings": vars(args) | {"model": str(args.model)},
    }
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
