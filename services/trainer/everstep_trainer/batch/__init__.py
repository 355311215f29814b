"""The samples of a train step and their layouts for the model: padded (`samples`), packed (`packing`), packed with
shared prompts (`shared_prompts`). Plain tensors and dataclasses: no model here."""
