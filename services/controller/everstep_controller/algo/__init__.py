"""The algorithm: the C3PO++ and sync schedulers, the training batch and its GRPO advantages (layer 5)."""
