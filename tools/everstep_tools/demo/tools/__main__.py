"""`python -m everstep_tools.demo.tools --out DIR [--seed S] [--quick]`: build the tools demo model directory
(examples/demo-tools-model). Writes build.json last and prints warm_start.json's summary as one JSON line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m everstep_tools.demo.tools", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="directory to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, weights and warm start")
    parser.add_argument("--quick", action="store_true", help="tiny and fast, for tests (no accuracy target)")
    parser.add_argument("--tool-use-probability", type=float, default=None,
                        help="the warm start's share of problems solved with the tool (default: the build's)")
    parser.add_argument("--sft-steps", type=int, default=None, help="warm-start optimizer steps (default: the build's)")
    parser.add_argument("--mechanics-tool-use-probability", type=float, default=None,
                        help="the first phase's share of tool traces (default: the build's)")
    parser.add_argument("--learning-rate", type=float, default=None, help="the first phase's peak learning rate")
    parser.add_argument("--hidden-size", type=int, default=None, help="model width (default: the build's)")
    parser.add_argument("--num-layers", type=int, default=None, help="transformer blocks (default: the build's)")
    parser.add_argument("--num-heads", type=int, default=None, help="attention heads (default: the build's)")
    parser.add_argument("--num-kv-heads", type=int, default=None, help="key/value heads (default: the build's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from everstep_tools.demo.build import write_build_manifest
    from everstep_tools.demo.tools.build import ToolsBuildConfig, build_tools_demo, quick_tools_build_config

    config = quick_tools_build_config(args.seed) if args.quick else ToolsBuildConfig(seed=args.seed)
    try:
        if args.tool_use_probability is not None:
            config.tool_use_probability = args.tool_use_probability
        if args.sft_steps is not None:
            config.sft = dataclasses.replace(config.sft, max_steps=args.sft_steps)
        if args.learning_rate is not None:
            config.sft = dataclasses.replace(config.sft, learning_rate=args.learning_rate)
        if args.mechanics_tool_use_probability is not None:
            config.mechanics_tool_use_probability = args.mechanics_tool_use_probability
        shape = {"hidden_size": args.hidden_size, "num_layers": args.num_layers, "num_heads": args.num_heads,
                 "num_kv_heads": args.num_kv_heads}
        config.model = dataclasses.replace(config.model, **{k: v for k, v in shape.items() if v is not None})
        config.__post_init__()
    except ValueError as error:
        parser.error(str(error))
    summary = build_tools_demo(args.out, config)
    given = sys.argv[1:] if argv is None else argv
    write_build_manifest(args.out, config,
                         shlex.join(["python", "-m", "everstep_tools.demo.tools", *given]))
    summary.pop("config")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
