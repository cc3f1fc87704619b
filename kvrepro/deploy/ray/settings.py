"""The ray target's own settings: ``ray:`` of matrix.yaml, typed and checked here (as the docker
target owns ``docker:`` and ``hosts:`` in ``deploy/docker/settings.py``)."""

from __future__ import annotations

import ipaddress
import os
import re

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
    engine: str = Field(
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

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        """Any target with node-engine hooks (kvrepro.deploy.node_engines): this target names none."""
        from .. import node_engines

        default = cls.model_fields["engine"].default
        engines = sorted(node_engines(), key=lambda name: (name != default, name))  # the default first
        if v not in engines:
            named = [repr(name) for name in engines]
            raise ValueError(f"Input should be {' or '.join([', '.join(named[:-1]), named[-1]] if len(named) > 1 else named)}")
        return v

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and (problem := address_problem(v)) is not None:
            raise ValueError(problem)
        return v


# a DNS name: labels of letters, digits and '-', dot-separated (no spaces, no scheme, no path)
_HOST_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                        r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def address_problem(value: str) -> str | None:
    """Why ``value`` is not a Ray cluster address (None if it is one): ``auto``, ``host:port`` or
    ``ray://host:port``, the host a DNS name, an IPv4 address or ``[IPv6]``. One check for
    ``ray.address`` and ``$RAY_ADDRESS``, so neither reaches Ray (or a socket) malformed."""
    usage = "give host:port (e.g. 10.0.0.5:6379), ray://host:10001 or auto"
    shown = repr(value[:80])
    if value == "auto":
        return None
    rest = value.removeprefix("ray://")
    if "://" in rest:
        return f"{shown}: {rest.split('://')[0]}:// is not a Ray address scheme; {usage}"
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"{shown}: {usage}"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
            return None
        except ValueError:
            return f"{shown}: {host} is not an IPv6 address; {usage}"
    if not _HOST_NAME.match(host):
        return f"{shown}: {host!r} is not a host name or IP address; {usage}"
    return None


def _parse(matrix: Matrix) -> RaySpec:
    try:
        return RaySpec.model_validate(matrix.section("ray") or {})
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
    """``ray.address``, else ``$RAY_ADDRESS``; None: neither is set. A malformed $RAY_ADDRESS is
    bad input (SpecError, exit 2)."""
    if spec.address:
        return spec.address
    env = os.environ.get("RAY_ADDRESS") or None
    if env is not None and (problem := address_problem(env)) is not None:
        raise SpecError(f"RAY_ADDRESS={problem}; or set ray.address in matrix.yaml")
    return env


def check_environment(matrix: Matrix) -> None:
    """Before anything is recorded for a run on the ray target: what comes from the environment
    ($RAY_ADDRESS) is checked as matrix.yaml's fields are (SpecError, exit 2)."""
    cluster_address(ray_settings(matrix))
