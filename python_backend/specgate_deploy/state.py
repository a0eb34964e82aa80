"""The replicas file: where each replica listens and which processes it runs, for tests and operators.

`make serve REPLICAS=N` writes it to artifacts/replicas.json (docs/deploy.md, "The replicas file")
whenever a replica starts, becomes ready, restarts or stops; written to a temporary file and renamed,
so a reader never sees half of one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ReplicaStatus = Literal["starting", "ready", "restarting", "draining", "stopped", "failed"]  # failed: restarts given up


class PortSet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    http: int
    grpc: int
    metrics: int
    front: int


class ReplicaRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str  # "replica-0": also its `pod` label in Prometheus
    ports: PortSet
    tritonserver_pid: int | None
    front_pid: int | None
    status: ReplicaStatus
    restarts: int = 0  # times the supervisor restarted its tritonserver


class PublicPorts(BaseModel):
    model_config = ConfigDict(extra="forbid")

    http: int
    grpc: int
    front: int
    prometheus: int
    haproxy_stats: int


class ClusterState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    launcher_pid: int
    haproxy_pid: int | None
    prometheus_pid: int | None
    public: PublicPorts
    replicas: list[ReplicaRecord]
    updated_at: float = Field(default_factory=time.time)  # Unix time of this write


def write_state(path: Path, state: ClusterState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(state.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)


def read_state(path: Path) -> ClusterState:
    return ClusterState.model_validate_json(path.read_text())
