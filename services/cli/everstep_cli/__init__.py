"""The `everstep` command line (`everstep ...` or `python -m everstep_cli ...`): the demo, the local stack,
job submission and following over the controller's REST API. It may import everstep_controller; the
controller never imports it."""
