"""The policy model: loading and per-token log-probs (`hf_model`), LoRA adapters (`lora`), MoE routing replay
(`routing`), ranks and FSDP2 (`distributed`), and the checkpoint files (`checkpoint`)."""
