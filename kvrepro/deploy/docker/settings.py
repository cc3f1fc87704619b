"""The docker target's own settings: ``hosts:``, ``docker:`` and ``base_image:`` of matrix.yaml,
typed and checked here (the way a load profile owns its ``Settings``).

spec/ keeps these sections as the JSON values written (:meth:`kvrepro.spec.matrix.Matrix.section`);
:func:`check_settings` is what kvrepro.matrix.load_matrix hands to the spec's parser, so their
errors carry file:line like every other field's; :func:`docker_settings` gives the typed form
to whoever runs the target.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ...errors import SpecError
from ...spec.matrix import MAX_HOSTS, FieldError, Matrix


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HostSpec(_Strict):
    """A Docker host (docker target): where images are assembled and engine containers run."""

    name: str = Field(description="how docker.nodes and `kvrepro hosts check` refer to this host")
    docker: str = Field("unix:///var/run/docker.sock", description="unix://, ssh://user@host or tcp://host:port")
    gpus: int = Field(0, ge=0, description="GPUs an engine container on this host gets (0: the GPU-free engine)")
    address: str | None = Field(None, description="address other nodes (and the load generator) use to reach this host")
    tls: bool = False
    tls_verify: bool = Field(True, description="tcp:// with tls: check the daemon's certificate against the CA")
    cert_path: str | None = Field(
        None, description="tcp:// with tls: folder holding ca.pem, cert.pem, key.pem (default: $DOCKER_CERT_PATH)"
    )
    ssh_config: str | None = Field(
        None, description="ssh://: the ssh client config file to use (ssh -F); default: ~/.ssh/config as `ssh` reads it"
    )
    api_address: str | None = Field(
        None, description="publish engine APIs on this IP of the host and call them there; default: the host's "
                          "loopback, reached through the ssh connection (required for remote tcp:// hosts)"
    )
    local: bool | None = Field(
        None, description="whether this daemon runs on this machine (bind mounts, 127.0.0.1); null: decided by "
                          "comparing the daemon's ID with the local daemon's, never by the address"
    )

    @field_validator("name")
    @classmethod
    def _host_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v):
            raise ValueError("use letters, digits, '_', '.', '-' (it becomes part of container names)")
        return v

    @field_validator("docker")
    @classmethod
    def _docker_url(cls, v: str) -> str:
        if not re.match(r"^(unix|ssh|tcp|http|https)://", v):
            raise ValueError("must start with unix://, ssh:// or tcp:// (e.g. unix:///var/run/docker.sock, "
                             "ssh://user@gpu-node-1, tcp://10.0.0.5:2376)")
        return v


class DockerSpec(_Strict):
    """How the docker target runs an engine. Secrets are named here, never given: see pass_env."""

    nodes: list[str] = Field(
        default_factory=list,
        description="hosts (by name, from hosts:) that together run one engine, head first; "
                    "empty: the first host, or the local daemon when hosts: is empty",
    )
    multi_node: Literal["nnodes", "data-parallel"] = Field(
        "nnodes",
        description="with several nodes: `nnodes` (one model across nodes: --nnodes/--node-rank/--master-addr, "
                    "--headless on the others) or `data-parallel` (--data-parallel-* with --headless on the others)",
    )
    rendezvous_port: int = Field(29501, ge=1, le=65535,
                                 description="--master-port (nnodes) or --data-parallel-rpc-port (data-parallel)")
    data_parallel_size_local: int | None = Field(
        None, ge=1, description="data-parallel: engines per node (default: the host's gpus, at least 1)"
    )
    api_port: int | None = Field(None, ge=1, le=65535,
                                 description="host port of the head's API; default: any free port")
    container_port: int = Field(8000, ge=1, le=65535, description="the API port inside the container (bridge network)")
    ipc_host: bool = Field(True, description="--ipc=host, as vLLM's docs run it (shared memory for workers)")
    shm_size: str | None = Field("16g", description="--shm-size when ipc_host is false, e.g. 16g")
    hf_cache: str | None = Field(
        "kvrepro-hf-cache",
        description="mounted at hf_cache_target: a named volume, or an absolute path on the host; null: none",
    )
    hf_cache_target: str = "/root/.cache/huggingface"
    vllm_cache: str | None = Field(
        "kvrepro-vllm-cache",
        description="named volume, one per base release (<name>-<release>), holding vLLM's cache folder "
                    "(VLLM_CACHE_ROOT): without it every container inspects the model classes again in "
                    "subprocesses (10-20 s a start); null: none",
    )
    pass_env: list[str] = Field(
        default_factory=lambda: ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"],
        description="NAMES of variables copied from your environment into the engine container when set "
                    "(tokens); their values never reach results, manifests, labels or logs",
    )
    env: dict[str, str] = Field(default_factory=dict, description="plain (non-secret) variables for the engine")
    health_timeout_s: float | None = Field(None, gt=0, description="default: runs.start_timeout_s")
    stop_timeout_s: float = Field(10.0, ge=0, description="SIGTERM to SIGKILL grace at teardown")
    log_stall_s: float = Field(
        20.0, gt=0, description="watchdog: a container log stream silent this long is checked and reopened if hung"
    )
    pull: bool = Field(True, description="pull base_image on a host that does not have it")
    gpu_free: Literal["auto", "yes", "no"] = Field(
        "auto",
        description="pass the GPU-free engine's settings (--num-gpu-blocks-override, KVREPRO_SIM_*): "
                    "auto = when the engine's hosts declare no GPUs; on GPUs (no) a real vLLM gets the GPU "
                    "path's arguments instead (docs/docker.md)",
    )
    gpu_attention_backend: str | None = Field(
        "FLASH_ATTN",
        description="GPU path: the attention backend for the target model (--attention-backend) AND the MTP "
                    "drafter (attention_backend in --speculative-config; vLLM never lets the drafter inherit the "
                    "target's): the backend whose hybrid block alignment the GPU-free engine reproduces; null: "
                    "vLLM picks each",
    )
    gpu_kv_blocks: Literal["matrix", "all"] = Field(
        "matrix",
        description="GPU path: matrix = cap the KV pool at engine.sim.num_gpu_blocks (--num-gpu-blocks-override), "
                    "the cache pressure the load was made for; all = whatever the GPU's memory holds (on a "
                    "large GPU nothing is evicted and prefix-reuse bugs do not appear)",
    )

    @field_validator("gpu_attention_backend")
    @classmethod
    def _backend_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Z][A-Z0-9_]{1,63}", v):
            raise ValueError("a vLLM attention backend name such as FLASH_ATTN, FLASHINFER or TRITON_ATTN "
                             "(vLLM's AttentionBackendEnum), or null")
        return v

    @field_validator("pass_env")
    @classmethod
    def _env_names(cls, v: list[str]) -> list[str]:
        for i, name in enumerate(v):
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                # Not echoed: an entry like NAME=value would put the secret into the error.
                shown = name.split("=", 1)[0][:40]
                raise ValueError(f"entry {i} ({shown!r}...) is not an environment variable NAME; "
                                 "list names only, never values")
        return v

    @field_validator("env")
    @classmethod
    def _no_secret_values(cls, v: dict[str, str]) -> dict[str, str]:
        from ...secrets import is_secret_name

        for name in v:
            if is_secret_name(name):
                raise ValueError(f"{name} looks like a secret: do not write its value here; "
                                 f"list the name under docker.pass_env and export it in your shell")
        return v

    @field_validator("vllm_cache")
    @classmethod
    def _volume_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,100}", v):
            raise ValueError("a Docker volume name (letters, digits, '_', '.', '-'), e.g. kvrepro-vllm-cache; "
                             "null for none")
        return v

    @field_validator("shm_size")
    @classmethod
    def _shm(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"\d+[bkmgBKMG]?", v):
            raise ValueError("a size such as 16g, 512m or 1073741824")
        return v


@dataclass(frozen=True)
class DockerSettings:
    """The docker target's settings of one matrix, typed."""

    hosts: tuple[HostSpec, ...]
    docker: DockerSpec
    base_image: str | None = None

    def image_for(self, base: str) -> str:
        """The image builds of ``base`` are assembled on."""
        return self.base_image or f"vllm/vllm-openai:v{base}"


def _field_error(prefix: tuple[Any, ...], model: type[BaseModel], exc: ValidationError) -> FieldError:
    """The first problem of a section, as the spec's FieldError (file:line is added by the parser)."""
    first = exc.errors()[0]
    loc = prefix + tuple(first["loc"])
    if first["type"] == "extra_forbidden":
        return FieldError(loc, f"unknown field; allowed here: {', '.join(model.model_fields)}")
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] in ("less_than_equal", "too_long"):
        msg += " (a limit of kvrepro's, see docs/reliability.md)"
    return FieldError(loc, msg)


def _parse(matrix: Matrix) -> DockerSettings:
    listed = matrix.section("hosts")
    if listed is None:
        listed = []
    if not isinstance(listed, list):
        raise FieldError(("hosts",), "a list of hosts, e.g. - {name: gpu-0, docker: ssh://ops@gpu-0}")
    if len(listed) > MAX_HOSTS:
        raise FieldError(("hosts",), f"{len(listed)} hosts; at most {MAX_HOSTS} (a limit of kvrepro's, see "
                                     "docs/reliability.md)")
    hosts = []
    for i, raw in enumerate(listed):
        try:
            hosts.append(HostSpec.model_validate(raw))
        except ValidationError as exc:
            raise _field_error(("hosts", i), HostSpec, exc) from None
    try:
        docker = DockerSpec.model_validate(matrix.section("docker") or {})
    except ValidationError as exc:
        raise _field_error(("docker",), DockerSpec, exc) from None
    base_image = matrix.section("base_image")
    if base_image is not None and not isinstance(base_image, str):
        raise FieldError(("base_image",), "an image reference, e.g. vllm/vllm-openai:v0.26.0")
    return DockerSettings(hosts=tuple(hosts), docker=docker, base_image=base_image)


def check_settings(matrix: Matrix) -> None:
    """``hosts:`` and ``docker:`` checked by their types; raises the spec's FieldError.
    kvrepro.matrix hands this to parse_matrix."""
    _parse(matrix)


_CACHE: dict[int, tuple[Matrix, DockerSettings]] = {}


def docker_settings(matrix: Matrix) -> DockerSettings:
    """The typed settings of ``matrix`` (a matrix loaded by kvrepro.matrix was checked already;
    one parsed without the check raises the FieldError here)."""
    cached = _CACHE.get(id(matrix))
    if cached is not None and cached[0] is matrix:
        return cached[1]
    try:
        settings = _parse(matrix)
    except FieldError as exc:
        raise SpecError(f"{'.'.join(str(p) for p in exc.loc)}: {exc}") from None
    if len(_CACHE) > 64:
        _CACHE.clear()
    _CACHE[id(matrix)] = (matrix, settings)
    return settings
