"""The demo: a tiny Llama (or Qwen3-MoE) warm-started on a synthetic arithmetic task with verifiable answers.

`python -m everstep_tools.demo --out DIR [--architecture qwen3_moe]` builds it; see `build.py` for what DIR holds.
The tools demo's model (multiplication with the sandbox's `python` tool) has its own builder in `tools/`.
"""

ARCHITECTURES = ("llama", "qwen3_moe")
"""What `python -m everstep_tools.demo --architecture` builds: the dense Llama of examples/demo-model, or
the Qwen3-MoE of examples/demo-moe-model."""
