"""everstep trainer service: IcePop/TIS policy loss, the policy trainer, weight push, gRPC server.

Folders by concept, lowest layer first (none imports a later one):

- `batch/`        the samples and how a micro-batch is laid out: `samples` (`TrainSample`, `PaddedBatch`),
                  `packing` (token-budgeted micro-batches, `PackedRows`), `shared_prompts` (`SharedPromptRows`).
- `model/`        the model: `hf_model` (loading, per-token log-probs and entropy, saving), `lora`, `routing`
                  (MoE routing replay), `distributed` (ranks, FSDP2 `parallelize`, full state dicts), `checkpoint`.
- `step/`         the train step: `losses` (pure policy-loss functions), `optim`, `micro_batches`, `stats`
                  (`TrainStats`), `trainer` (`PolicyTrainer`).
- `weight_push/`  weight transports from the trainer to the rollout engines.
- the service:    `server` (gRPC), `rank_commands` (what rank 0 broadcasts), `metrics`, `sample_log`, `__main__`.

The package root imports nothing heavy; import the modules you need.
"""
