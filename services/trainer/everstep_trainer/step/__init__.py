"""The train step: the policy losses (`losses`, pure functions), the optimizer and its schedule (`optim`), the
micro-batch plan (`micro_batches`), the step's statistics (`stats`) and the `PolicyTrainer` that runs it
(`trainer`)."""
