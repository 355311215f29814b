"""The `everstep` command line (`everstep ...` or `python -m everstep_cli ...`): the demo, the local stack,
job submission and following over the controller's REST API. A client: it imports the shared `everstep` package
(the job spec and metrics models of `everstep.rest`, `everstep.processes` for the local stack's processes) and no
service's package; it starts the services as processes (`python -m everstep_controller ...`)."""
