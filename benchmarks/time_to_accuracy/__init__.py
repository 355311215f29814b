"""Time to accuracy, everstep against TRL (`python -m benchmarks.time_to_accuracy`): the flags and the summary in
`cli`, what every arm shares in `config`, the settings from flags and spec in `resolve`, running the arms in `run`,
the everstep arms in `everstep_arm` and the TRL arms (a process of their own) in `trl_arm`."""
