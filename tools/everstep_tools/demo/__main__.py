"""`python -m everstep_tools.demo --out DIR [--architecture llama|qwen3_moe] [--seed S] [--quick]`: build the
demo model directory (llama: examples/demo-model; qwen3_moe: examples/demo-moe-model, 8 experts, top-2).

Writes build.json last (this command, the settings, the versions, every file's sha256) and prints
warm_start.json's summary as one JSON line at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from everstep_tools.demo import ARCHITECTURES

if TYPE_CHECKING:
    from everstep_tools.demo.build import BuildConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m everstep_tools.demo", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="directory to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, weights and warm start")
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="llama",
                        help="llama: the dense demo model; qwen3_moe: the mixture-of-experts one (default: llama)")
    parser.add_argument("--quick", action="store_true", help="tiny and fast, for tests (no accuracy target)")
    parser.add_argument("--moe-intermediate-size", type=int, default=None,
                        help="qwen3_moe: width of each expert's MLP (default: the build's)")
    parser.add_argument("--no-eval", action="store_true", help="skip scoring the warm start")
    parser.add_argument("--sft-steps", type=int, default=None,
                        help="warm-start optimizer steps (default: the build's; fewer is faster and weaker)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="examples per optimizer step in both warm-start phases (default: the build's)")
    parser.add_argument("--max-ops", type=int, default=None,
                        help="longest chain of the task (default: the build's; fewer makes shorter solutions)")
    parser.add_argument("--slip-probability", type=float, default=None,
                        help="warm start on a sloppy teacher's solutions that slip by one with this chance per step")
    parser.add_argument("--direct-answer-probability", type=float, default=None,
                        help="the terse phase's chance of a bare boxed answer (0: no terse phase)")
    parser.add_argument("--label-smoothing", type=float, default=None, help="warm-start label smoothing")
    parser.add_argument("--terse-sft-steps", type=int, default=None,
                        help="optimizer steps of the terse phase (default: the build's; more: a lower base accuracy)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from everstep_tools.demo.build import (
        BuildConfig,
        build_demo,
        moe_build_config,
        quick_build_config,
        quick_moe_shape,
        write_build_manifest,
    )

    moe = args.architecture == "qwen3_moe"
    if args.quick:
        config = quick_build_config(args.seed)
        if moe:
            config.model = quick_moe_shape()
    else:
        config = moe_build_config(args.seed) if moe else BuildConfig(seed=args.seed)
    try:
        _apply_arguments(config, args)
    except ValueError as error:
        parser.error(str(error))
    summary = build_demo(args.out, config)
    given = sys.argv[1:] if argv is None else argv
    write_build_manifest(args.out, config, shlex.join(["python", "-m", "everstep_tools.demo", *given]))
    summary.pop("config")
    print(json.dumps(summary))


def _apply_arguments(config: BuildConfig, args: argparse.Namespace) -> None:
    """Override ``config`` with the options given; a bad value raises ValueError naming its field."""
    if args.no_eval:
        config.evaluate = False
    if args.sft_steps is not None:
        config.sft = dataclasses.replace(config.sft, max_steps=args.sft_steps)
    if args.batch_size is not None:
        config.sft = dataclasses.replace(config.sft, batch_size=args.batch_size)
        config.terse_sft = dataclasses.replace(config.terse_sft, batch_size=args.batch_size)
    if args.max_ops is not None:
        config.task = dataclasses.replace(config.task, max_ops=args.max_ops)
    if args.terse_sft_steps is not None:
        config.terse_sft = dataclasses.replace(config.terse_sft, max_steps=args.terse_sft_steps)
    if args.moe_intermediate_size is not None:
        if args.architecture != "qwen3_moe":
            raise ValueError("--moe-intermediate-size (model.moe_intermediate_size) needs --architecture qwen3_moe")
        config.model = dataclasses.replace(config.model, moe_intermediate_size=args.moe_intermediate_size)
    if args.label_smoothing is not None:
        config.sft = dataclasses.replace(config.sft, label_smoothing=args.label_smoothing)
    if args.slip_probability is not None:
        config.slip_probability = args.slip_probability
    if args.direct_answer_probability is not None:
        config.direct_answer_probability = args.direct_answer_probability
    config.__post_init__()  # validates the values


if __name__ == "__main__":
    main()
