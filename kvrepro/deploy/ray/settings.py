"""The ray target's own settings: ``ray:`` of matrix.yaml, typed and checked here (as the docker
target owns ``docker:`` and ``hosts:`` in ``deploy/docker/settings.py``)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ...errors import SpecError
from ...spec.matrix import FieldError, Matrix

# how often a run whose node (or worker) was lost is sent again, when ray.max_retries is not set
DEFAULT_MAX_RETRIES = 2


class RaySpec(BaseModel):
    """``ray:``: which cluster, and what one run reserves on it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str | None = Field(
        None, description="the cluster: host:port of its GCS (`ray start --head --port`), ray://host:10001 "
                          "(Ray Client, e.g. a KubeRay head service) or auto; default: $RAY_ADDRESS")
    cpus_per_run: float = Field(1.0, gt=0, le=256, description="logical CPUs a run reserves on each of its "
                                                               "nodes (the GPU-free engine: one)")
    gpus_per_run: float = Field(0.0, ge=0, le=64, description="GPUs a run reserves on each of its nodes "
                                                             "(0: the GPU-free engine)")
    nodes_per_engine: int = Field(1, ge=1, le=64,
                                  description="nodes one engine spans; above 1 each run holds a placement group "
                                              "of that many bundles (cpus_per_run/gpus_per_run each), one per "
                                              "node (STRICT_SPREAD), and its task runs in bundle 0")
    engine: Literal["sim", "docker"] = Field(
        "sim", description="how a node starts the engine: sim (vLLM's `vllm serve` with the GPU-free plugin in "
                           "the node's runtime env) or docker (the build's patched image in the node's own "
                           "Docker daemon, made there once; base_image: and docker: apply, hosts: must be empty)")
    max_retries: int = Field(DEFAULT_MAX_RETRIES, ge=0, le=10,
                             description="a run whose node or worker was lost is INFRA and sent again, "
                                         "to another node when one is alive, at most this often")
    connect_timeout_s: float = Field(5.0, gt=0, le=300,
                                     description="how long the cluster's address may take to answer a TCP connect")
    ship_code: bool = Field(False, description="send this kvrepro's package to the workers (runtime_env "
                                               "py_modules); false: the nodes have kvrepro installed")
    cancel_grace_s: float = Field(15.0, ge=0, le=600,
                                  description="Ctrl-C: how long a cancelled run may take to stop its engine "
                                              "before its worker is killed")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is None or v == "auto":
            return v
        rest = v.removeprefix("ray://")
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{v!r}: give host:port (e.g. 10.0.0.5:6379), ray://host:10001 or auto")
        return v


def _parse(matrix: Matrix) -> RaySpec:
    try:
        return RaySpec.model_validate(matrix.ray.raw())
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ("ray",) + tuple(first["loc"])
        if first["type"] == "extra_forbidden":
            raise FieldError(loc, f"unknown field; allowed here: {', '.join(RaySpec.model_fields)}") from None
        raise FieldError(loc, first["msg"].removeprefix("Value error, ")) from None


def check_settings(matrix: Matrix) -> None:
    """``ray:`` checked by its type; raises the spec's FieldError (kvrepro.matrix hands this to parse_matrix)."""
    _parse(matrix)


def ray_settings(matrix: Matrix) -> RaySpec:
    try:
        return _parse(matrix)
    except FieldError as exc:
        raise SpecError(f"{'.'.join(str(p) for p in exc.loc)}: {exc}") from None


def cluster_address(spec: RaySpec) -> str | None:
    """``ray.address``, else ``$RAY_ADDRESS``; None: neither is set."""
    return spec.address or os.environ.get("RAY_ADDRESS") or None
