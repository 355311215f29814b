"""The tools demo: a tiny Llama that multiplies with the sandbox's `python` tool (examples/demo-tools-model).

`python -m everstep_tools.demo.tools --out DIR` builds it: a byte-level BPE tokenizer with Qwen2.5's control
tokens and chat template (tools in the system turn, Hermes `<tool_call>` calls, `<tool_response>` replies in the
tool role), and a warm start in which a minority of answers call the tool; see `build.py`.
"""
