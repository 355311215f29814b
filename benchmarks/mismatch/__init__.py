"""Training under a rollout/trainer mismatch: IcePop and TIS against a quantized engine
(`python -m benchmarks.mismatch.icepop`), and the same harness on a MoE with routing replay
(`python -m benchmarks.mismatch.moe`). `records` holds what a run records, `reports` reads saved reports back,
combines them and plots them."""
