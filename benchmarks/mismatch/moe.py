"""IcePop and routing replay under a real MoE mismatch: `python -m benchmarks.mismatch.moe [--quick] [--model DIR]
[--quantization none|int8|fp8] [--out DIR] ...`.

The `benchmarks.mismatch.icepop` experiment (the same harness, flags, files and summary) on a mixture-of-experts
model, where a mismatched engine also routes tokens to other experts than the float32 trainer would. Arms,
identical but for the engine, the correction and routing replay (R3):

  fp32-none       float32 engine, no correction (the control: no engine mismatch)
  bf16-none       bfloat16-compute engine, plain GRPO
  bf16-tis        ... truncated importance sampling, cap --tis-cap (2)
  bf16-icepop     ... IcePop masking outside [--alpha, --beta] ([0.5, 5])
  bf16-r3         ... routing replay: the trainer replays the engine's routes (`routing_replay: rollout`)
  bf16-r3-icepop  ... routing replay and IcePop
  bf16-r3-icepop-b2  ... routing replay and IcePop with the tighter band [--alpha, 2]
  bf16-r3-seq     ... routing replay and IcePop at sequence level (`correction_level: sequence`: one k per sample,
                  the product of its tokens' k; the whole sample kept with weight k inside [--alpha, --beta], else
                  masked)
  bf16-r3-mask    ... routing replay and IcePop's mask alone: kept tokens weigh 1, not k (an ablation that no job
                  setting gives, `icepop.mask_only_icepop`), to tell IcePop's masking from its weighting

`--quantization int8` or `fp8` replaces the bfloat16 engine by a float32 engine with int8 (per output channel) or
fp8 weights, and renames the arms (`int8-none` ...). Every arm asks the engine for its routes
(`return_routed_experts`) and sends them with the samples, so the trainer reports its routing disagreement with
the engine (the fraction of (token, MoE layer) pairs whose top-k set under its own router differs) in every
arm; only the r3 arms replay them. The summary has, besides icepop_mismatch's figures,
routing_disagreement_mean per arm (mean over steps, then seeds). Writes OUT/moe_mismatch.json and .png.

The model must be a Qwen3-MoE demo-task model (config.json, train.jsonl, eval.jsonl): by default
examples/demo-moe-model, which this benchmark does not build. A tiny random Qwen3-MoE with the demo task's
prompts runs the harness (the tests do) but cannot learn the task: only its mismatch figures mean anything.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.mismatch.icepop import build_parser, finish_args, run_experiment
from benchmarks.mismatch.records import Arm

DEFAULT_MODEL = Path("examples/demo-moe-model")
QUANTIZATIONS = ("none", "int8", "fp8")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def arms(quantization: str) -> list[Arm]:
    """The float32 control, then the mismatched engine's none / TIS / IcePop / R3 / R3 + IcePop arms, and R3 + IcePop
    with the band [alpha, 2] and at sequence level."""
    prefix, dtype = ("bf16", "bfloat16") if quantization == "none" else (quantization, "float32")
    # (suffix, correction, routing replay, IcePop's beta (None: --beta), correction level); r3-mask: mask_only
    mismatched = [("none", "none", "off", None, "token"), ("tis", "tis", "off", None, "token"),
                  ("icepop", "icepop", "off", None, "token"), ("r3", "none", "rollout", None, "token"),
                  ("r3-icepop", "icepop", "rollout", None, "token"),
                  ("r3-icepop-b2", "icepop", "rollout", 2.0, "token"),
                  ("r3-seq", "icepop", "rollout", None, "sequence"), ("r3-mask", "icepop", "rollout", None, "token")]
    return [Arm(name="fp32-none", quantization="none", correction="none", routes=True),
            *(Arm(name=f"{prefix}-{suffix}", quantization=quantization, dtype=dtype, correction=correction,
                  routing_replay=replay, routes=True, beta=beta, correction_level=level, mask_only=suffix == "r3-mask")
              for suffix, correction, replay, beta, level in mismatched)]


def check_moe_model(model_dir: Path) -> None:
    """Refuse (SystemExit naming --model) a folder that does not exist or whose config is not an MoE model."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise SystemExit(f"moe_mismatch: --model {model_dir}: no model there (no config.json). The default, "
                         f"{DEFAULT_MODEL}, is the MoE demo model, which this benchmark does not build; pass "
                         "--model DIR with a Qwen3-MoE demo-task model (config.json, train.jsonl, eval.jsonl)")
    config = json.loads(config_path.read_text())
    if not any(isinstance(config.get(key), int) and config[key] > 0 for key in EXPERT_KEYS):
        raise SystemExit(f"moe_mismatch: --model {model_dir}: not an MoE model (model_type "
                         f"{config.get('model_type')!r}, no experts in config.json); pass --model DIR with a "
                         "Qwen3-MoE demo-task model (benchmarks.mismatch.icepop runs dense models)")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = build_parser(
        "python -m benchmarks.mismatch.moe", __doc__, default_model=DEFAULT_MODEL,
        model_help=f"Qwen3-MoE demo-task model directory with train.jsonl and eval.jsonl (default {DEFAULT_MODEL}, "
                   "never built here)",
        default_out=Path("outputs/moe-mismatch"), quantizations=QUANTIZATIONS, default_quantization="none",
        quantization_help="the mismatched engine: none (bfloat16 compute, float32 weights), or float32 compute "
                          "with int8 (per output channel) or fp8 weights",
        report="moe_mismatch.json")
    return finish_args(parser.parse_args(argv), parser), parser


def main(argv: list[str] | None = None) -> dict:
    args, parser = parse_args(argv)
    engine = "bf16" if args.quantization == "none" else args.quantization
    return run_experiment(args, parser, arms(args.quantization), report="moe_mismatch",
                          title=f"MoE: {engine} rollouts vs float32 training: none / TIS / IcePop / R3 / R3 + IcePop",
                          prepare_model=check_moe_model)


if __name__ == "__main__":
    main()
