"""The controller's REST contract, as pydantic models both ends share: the job spec a user submits
(`job_spec.JobSpec`, with its `tracking_spec` section) and what a job reports back (`job_record.JobRecord` with
its state, `step_metrics.StepMetrics` and `Evaluation`, `step_samples.StepSample`). The controller validates and
serves them; the CLI builds and reads them without importing the controller. Checks that need the controller's
own libraries (datasets, chat templates, tracking libraries, model folders) stay in the controller
(`everstep_controller.spec`, `data.submission_checks`)."""
