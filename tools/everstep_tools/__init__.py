"""everstep's tools: programs run beside the services, never imported by them.

- `demo`            `python -m everstep_tools.demo`: builds the demo models (examples/demo-model, demo-moe-model);
                    `demo.tools`: the tools demo's model (examples/demo-tools-model).
- `model_import`    `everstep model import`: a GGUF file or a transformers directory as a plain Hugging Face one.
- `model_export`    `everstep model export`: a trainer checkpoint as a directory transformers or peft load.
"""
