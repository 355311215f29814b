"""What a user may change in a running job (`PATCH /v1/jobs/{id}`): today the size of its rollout pool.

Every level forbids other fields, so a request that names anything else is refused (422) with the field's path.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["JobChange", "PoolChange", "ResourcesChange"]


class PoolChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(ge=1, le=256, description="Engines in the job's rollout pool from its next iteration on.")


class ResourcesChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rollout: PoolChange


class JobChange(BaseModel):
    """`{"resources": {"rollout": {"replicas": M}}}`: the job's rollout pool becomes M engines between two
    iterations (new ones load the model and take the current weights first; removed ones drain and stop)."""

    model_config = ConfigDict(extra="forbid")

    resources: ResourcesChange
