"""Every setting declared once (field, default, check, description), torch-free: the job spec composes these
sections and the services run on them. `training`: algorithm, sampling, scheduler and trainer settings; `tools`:
the job's tools; `quantization`: the engine's weight quantization; `codec`: each settings model <-> its proto
message, field by field; `proto_enums`: settings enums <-> proto enums, by name."""
