"""A small client of the controller's REST API, used by the CLI.

Environment: EVERSTEP_URL (default http://127.0.0.1:8000), EVERSTEP_API_TOKEN (sent as a bearer
token), EVERSTEP_REST_CA (PEM CA bundle that signed an https controller's certificate; default: the
system's trust store).
"""

from __future__ import annotations

import os
import ssl
from typing import Any

import httpx


class ApiError(RuntimeError):
    pass


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
            raise ApiError(f"{method} {path} -> {response.status_code}: {response.text}")
        return response.json()

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/jobs", json=spec)

    def jobs(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/jobs")

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        return self._call("GET", f"/v1/jobs/{job_id}/metrics")

    def action(self, job_id: str, action: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/{action}")

    def close(self) -> None:
        self._http.close()
