"""everstep controller service: the REST job API and the job runners (`python -m everstep_controller`).

Subpackages by concept, in layer order (lowest first). A module imports only from its own layer or
from lower ones, never from a higher one, and the package has no import cycle
(tests/controller/test_package_layers.py checks both, imports inside functions included):

1. `settings`   the controller's own options (`ControllerSettings`): every flag's default and check, once.
2. `spec`       the job spec's checks beyond its schema (the schema, like every REST model, is the shared
                `everstep.rest`): its generated docs (`python -m everstep_controller.spec.docs`), field paths,
                the model's limits, the libraries of its tracking backends, the submission checks of the spec
                (`JobInputError`).
3. `data`       datasets and their columns, prompts, prompt rendering, chat templates, row tests, reward
                items and the classification of reward errors, submission checks of a job's input files
                (`check_job_input`: every submission check).
4. `store`      what lives in Redis: the job store, the progress store, streams, the Redis client.
5. `algo`       the C3PO++ and sync schedulers, the training batch, the advantage estimators by name.
6. `launchers`  who gives a job its rollout engines and trainer (local processes through `everstep.processes`,
                Kubernetes, shared).
7. `tracking`   experiment tracking: a job's rows, evaluations and spec to TensorBoard, W&B, MLflow.
8. `run`        running a job: the job manager and runners, the clients to the services, rollout phase,
                scoring, step commit, recovery, steps in flight, evaluation, Prometheus metrics.
9. `api`        the REST app and its request limits.
10. `__main__`  the service's entrypoint: flags (generated from `settings`), wiring, serving.

The `everstep` CLI (demo, local stack, REST client) is the separate package `everstep_cli`
(services/cli): a client of the REST API that imports neither this package nor any other service.
"""
