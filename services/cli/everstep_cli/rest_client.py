"""A small client of the controller's REST API, used by the CLI.

Environment: EVERSTEP_URL (default http://127.0.0.1:8000), EVERSTEP_API_TOKEN (sent as a bearer
token), EVERSTEP_REST_CA (PEM CA bundle that signed an https controller's certificate; default: the
system's trust store).
"""

from __future__ import annotations

import os
import ssl
from typing import Any
from urllib.parse import quote

import httpx


class ApiError(RuntimeError):
    """A failed call: `status` is the HTTP status (None: the controller could not be reached), `detail`
    the controller's explanation (FastAPI's `detail`) when it gave one."""

    def __init__(self, message: str, status: int | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail


class UnknownJob(ApiError):
    """The controller has no job of that id (404)."""


class ControllerClient:
    def __init__(self, url: str | None = None, token: str | None = None, timeout_seconds: float = 30.0,
                 ca_file: str | None = None) -> None:
        self.url = (url or os.environ.get("EVERSTEP_URL") or "http://127.0.0.1:8000").rstrip("/")
        token = token or os.environ.get("EVERSTEP_API_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        ca_file = ca_file or os.environ.get("EVERSTEP_REST_CA")
        verify = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_seconds, verify=verify)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise ApiError(f"cannot reach the controller at {self.url}: {e}") from e
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except (ValueError, AttributeError):
                detail = None
            raise ApiError(f"{method} {path} -> {response.status_code}: {response.text}", response.status_code, detail)
        return response.json()

    def _job_call(self, job_id: str, method: str, path: str, **kwargs: Any) -> Any:
        try:
            return self._call(method, path, **kwargs)
        except ApiError as e:
            if e.status == 404:
                raise UnknownJob(f"no job {job_id!r} at {self.url}", 404, e.detail) from None
            if e.status == 409 and isinstance(e.detail, str):
                raise ApiError(f"job {job_id}: {e.detail}", 409, e.detail) from None
            raise

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/jobs", json=spec)

    def jobs(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/jobs")

    def job(self, job_id: str) -> dict[str, Any]:
        """UnknownJob naming it when the controller has no such job."""
        return self._job_call(job_id, "GET", f"/v1/jobs/{quote(job_id, safe='')}")

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        return self._job_call(job_id, "GET", f"/v1/jobs/{quote(job_id, safe='')}/metrics")

    def samples(self, job_id: str, step: int | None = None) -> list[dict[str, Any]]:
        """A step's rendered samples (the latest step when None); ApiError (404) when the step has none."""
        query = f"?step={step}" if step is not None else ""
        try:
            return self._call("GET", f"/v1/jobs/{quote(job_id, safe='')}/samples{query}")
        except ApiError as e:
            if e.status == 404 and isinstance(e.detail, str) and e.detail.startswith("no job"):
                raise UnknownJob(f"no job {job_id!r} at {self.url}", 404, e.detail) from None
            raise

    def action(self, job_id: str, action: str) -> dict[str, Any]:
        """pause, resume or cancel; UnknownJob, or ApiError with the controller's reason (409: the job's
        state does not allow it)."""
        return self._job_call(job_id, "POST", f"/v1/jobs/{quote(job_id, safe='')}/{action}")

    def scale(self, job_id: str, *, rollout: int) -> dict[str, Any]:
        """The job's rollout pool resized to `rollout` engines (between two iterations); UnknownJob, or ApiError
        with the controller's reason (409: the job ended; 422: a size it refuses)."""
        return self._job_call(job_id, "PATCH", f"/v1/jobs/{quote(job_id, safe='')}",
                              json={"resources": {"rollout": {"replicas": rollout}}})

    def close(self) -> None:
        self._http.close()
