"""The REST job API (FastAPI). OpenAPI document at /openapi.json.

Every /v1 call needs `Authorization: Bearer <EVERSTEP_API_TOKEN>` when that variable is set;
/healthz, /livez, /readyz and /metrics stay open (probes and Prometheus), and carry no job data. /livez says
the process serves (the liveness probe), /readyz that Redis answers too (readiness); /healthz pings Redis.
Request bodies over `max_request_bytes` get 413. docs/security.md says what is and is not protected.
"""

from __future__ import annotations

import hmac
import os

from fastapi import Depends, FastAPI, HTTPException, Query, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from everstep.rest.job_change import JobChange
from everstep.rest.job_record import JobRecord
from everstep.rest.job_spec import JobSpec
from everstep.rest.step_metrics import StepMetrics
from everstep.rest.step_samples import StepSample
from everstep_controller.api.health import RedisProbe
from everstep_controller.api.request_limits import DEFAULT_MAX_REQUEST_BYTES, RequestSizeLimit
from everstep_controller.data.file_checks import check_job_input
from everstep_controller.run.manager import JobManager
from everstep_controller.spec.submission_checks import JobInputError
from everstep_controller.store.job_store import Action, JobStore

_bearer = HTTPBearer(auto_error=False, description="EVERSTEP_API_TOKEN of the controller, when it has one")


def _require_token(credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """When EVERSTEP_API_TOKEN is set, every /v1 call needs `Authorization: Bearer <token>`."""
    token = os.environ.get("EVERSTEP_API_TOKEN")
    if not token:
        return
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), token.encode()):  # constant time: no timing oracle on the token
        raise HTTPException(status_code=401, detail="missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})


def create_app(manager: JobManager, store: JobStore, *, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """max_request_bytes: larger request bodies are refused with 413 before they are read."""
    app = FastAPI(title="everstep controller", version="0.1.0",
                  description="Submit and follow RL jobs (GRPO with IcePop, C3PO++ rollouts).")
    app.add_middleware(RequestSizeLimit, max_bytes=max_request_bytes)
    v1 = [Depends(_require_token)]

    def get_job(job_id: str) -> JobRecord:
        record = store.get(job_id)
        if record is None:
            raise HTTPException(status_code=404, detail=f"no job {job_id!r}")
        return record

    @app.post("/v1/jobs", status_code=201, response_model=JobRecord, dependencies=v1)
    def create_job(spec: JobSpec) -> JobRecord:
        try:
            spec = check_job_input(spec)  # the files readable now (a field they lack is a 422 naming it); the
            # reward functions' sources filled in
        except JobInputError as e:
            raise HTTPException(status_code=422, detail=[e.detail()]) from None
        return manager.submit(spec)

    @app.get("/v1/jobs", response_model=list[JobRecord], dependencies=v1)
    def list_jobs() -> list[JobRecord]:
        return store.list()

    @app.get("/v1/jobs/{job_id}", response_model=JobRecord, dependencies=v1)
    def read_job(job_id: str) -> JobRecord:
        return get_job(job_id)

    @app.get("/v1/jobs/{job_id}/metrics", response_model=list[StepMetrics], dependencies=v1)
    def job_metrics(job_id: str) -> list[StepMetrics]:
        get_job(job_id)
        return store.metrics(job_id)

    @app.get("/v1/jobs/{job_id}/samples", response_model=list[StepSample], dependencies=v1)
    def job_samples(job_id: str, step: int | None = Query(default=None, ge=1, description=(
            "The training step (default: the latest one committed)."))) -> list[StepSample]:
        """A few of the step's trained samples as the model wrote them: its turns, tool calls and replies, and
        rewards (docs/tools.md)."""
        record = get_job(job_id)
        wanted = record.step if step is None else step
        samples = store.samples(job_id, wanted) if wanted else None
        if samples is None:
            raise HTTPException(status_code=404, detail=f"job {job_id!r} has no samples of step {wanted} (steps "
                                                        f"committed: {record.step})")
        return samples

    @app.patch("/v1/jobs/{job_id}", response_model=JobRecord, dependencies=v1)
    def change_job(job_id: str, change: JobChange) -> JobRecord:
        """Changes a job while it runs: `{"resources": {"rollout": {"replicas": M}}}` resizes its rollout pool
        between two iterations (any other field: 422 naming it; a job that ended: 409)."""
        get_job(job_id)
        try:
            return manager.resize_pool(job_id, change.resources.rollout.replicas)
        except ValidationError as e:
            raise HTTPException(status_code=422, detail=e.errors(include_url=False, include_context=False)) from None
        except ValueError as e:
            raise HTTPException(status_code=409, detail=str(e)) from e

    def act(job_id: str, action: Action) -> JobRecord:
        get_job(job_id)
        try:
            return manager.act(job_id, action)
        except ValueError as e:
            raise HTTPException(status_code=409, detail=str(e)) from e

    @app.post("/v1/jobs/{job_id}/pause", response_model=JobRecord, dependencies=v1)
    def pause_job(job_id: str) -> JobRecord:
        return act(job_id, Action.pause)

    @app.post("/v1/jobs/{job_id}/resume", response_model=JobRecord, dependencies=v1)
    def resume_job(job_id: str) -> JobRecord:
        return act(job_id, Action.resume)

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobRecord, dependencies=v1)
    def cancel_job(job_id: str) -> JobRecord:
        return act(job_id, Action.cancel)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        store.redis.ping()
        return {"status": "ok"}

    @app.get("/livez")
    def livez() -> dict[str, str]:
        """Liveness: the process serves. No dependency is checked, so a Redis outage never restarts it."""
        return {"status": "ok"}

    redis_probe = RedisProbe(store.redis)

    @app.get("/readyz", responses={503: {"description": "Redis is unreachable"}})
    def readyz(response: Response) -> dict[str, str]:
        """Readiness: Redis answers a PING within a few seconds (one try, not the store's retries)."""
        problem = redis_probe.problem()
        if problem is not None:
            response.status_code = 503
            return {"status": "unavailable", "redis": problem}
        return {"status": "ok"}

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
