"""everstep reward service: scores responses with a weighted mix of verifiers (math, code, format,
length, model)."""
