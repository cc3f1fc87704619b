"""The launch plan of one engine: which container runs on which host with which `vllm serve` flags.

Pure data in, pure data out (no Docker here), so that the multi-node flag layout can be checked
against vLLM's own argument parser in unit tests. The matrix's `vllm serve` arguments pass
through verbatim; this module only appends the flags that place the engine (API host/port, and
for several nodes vLLM's multi-node flags), and refuses matrices that already set those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import SpecError
from .settings import DockerSpec, HostSpec

# Flags this module owns, with the short aliases vLLM 0.26 registers for them. A matrix that
# sets one in engine.extra_args would fight the launch plan, so it is refused up front.
PLACEMENT_FLAGS = {
    "--host": (), "--port": (),
    "--headless": (),
    "--nnodes": ("-n",), "--node-rank": ("-r",), "--master-addr": (), "--master-port": (),
    "--data-parallel-size": ("-dp",), "--data-parallel-size-local": ("-dpl",),
    "--data-parallel-start-rank": ("-dpr",), "--data-parallel-address": ("-dpa",),
    "--data-parallel-rpc-port": ("-dpp",),
}


@dataclass(frozen=True)
class NodeLaunch:
    """One container of an engine."""

    rank: int
    host: str                     # HostSpec.name
    head: bool                    # serves the API (the load target); the others run --headless
    argv: tuple[str, ...]         # what follows `vllm serve`
    network: str                  # "bridge" (one node) or "host" (several: vLLM needs the host's addresses)
    container_port: int | None    # bridge: the API port inside the container
    host_port: int | None         # bridge: published port (None: the daemon picks); host: the API port
    bind_ip: str                  # address the API is published on / listens on
    gpus: int
    env: dict[str, str] = field(default_factory=dict)


def _flag_name(arg: str) -> str:
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


def check_no_placement_flags(serve_args: list[str]) -> None:
    owned = {long: long for long in PLACEMENT_FLAGS}
    owned.update({short: long for long, shorts in PLACEMENT_FLAGS.items() for short in shorts})
    clashes = sorted({owned[_flag_name(a)] for a in serve_args if _flag_name(a) in owned})
    if clashes:
        raise SpecError(
            f"engine.extra_args sets {', '.join(clashes)}, which the docker target sets itself "
            "(API address, and multi-node placement from docker.nodes / docker.multi_node); remove them"
        )


def plan_launch(serve_args: list[str], nodes: list[HostSpec], spec: DockerSpec, *, head_address: str,
                api_port: int | None, bind_ip: str, env: dict[str, str] | None = None) -> list[NodeLaunch]:
    """Containers for one engine on ``nodes`` (head first).

    ``serve_args`` is the `vllm serve` argument list (model first) from matrix.yaml;
    ``head_address`` is how the other nodes reach the head; ``api_port`` the head's API port on
    its host (None for one node: the daemon picks a free one); ``bind_ip`` where the API is
    reachable (127.0.0.1 for a local host).
    """
    if not nodes:
        raise SpecError("docker.nodes: an engine needs at least one host")
    check_no_placement_flags(serve_args)
    env = dict(env or {})
    base = list(serve_args)
    if len(nodes) == 1:
        node = nodes[0]
        argv = base + ["--host", "0.0.0.0", "--port", str(spec.container_port)]
        return [NodeLaunch(rank=0, host=node.name, head=True, argv=tuple(argv), network="bridge",
                           container_port=spec.container_port, host_port=api_port, bind_ip=bind_ip,
                           gpus=node.gpus, env=env)]

    if api_port is None:
        raise SpecError("several nodes run on the host network: the head's API port must be known (docker.api_port)")
    if spec.multi_node == "data-parallel" and spec.data_parallel_size_local is None:
        sizes = {max(n.gpus, 1) for n in nodes}
        if len(sizes) > 1:
            raise SpecError("docker.multi_node: data-parallel with hosts of different gpus: counts; "
                            "set docker.data_parallel_size_local so every node runs the same number of engines")
    count = len(nodes)
    launches = []
    for rank, node in enumerate(nodes):
        if spec.multi_node == "nnodes":
            # One model spread over all nodes (TP/PP across nodes): rank 0 owns the API and the
            # scheduler, the others run headless workers joining its torch.distributed group.
            flags = ["--nnodes", str(count), "--node-rank", str(rank),
                     "--master-addr", head_address, "--master-port", str(spec.rendezvous_port)]
        else:
            # Data parallel: every node runs `local` engine cores (each with its own scheduler);
            # the head also runs the API server and the DP coordinator the others hand-shake with.
            local = spec.data_parallel_size_local or max(node.gpus, 1)
            flags = ["--data-parallel-size", str(local * count), "--data-parallel-size-local", str(local),
                     "--data-parallel-address", head_address, "--data-parallel-rpc-port", str(spec.rendezvous_port)]
            if rank > 0:
                flags += ["--data-parallel-start-rank", str(local * rank)]
        if rank == 0:
            argv = base + flags + ["--host", bind_ip, "--port", str(api_port)]
        else:
            argv = base + flags + ["--headless"]
        launches.append(NodeLaunch(rank=rank, host=node.name, head=rank == 0, argv=tuple(argv), network="host",
                                   container_port=None, host_port=api_port if rank == 0 else None,
                                   bind_ip=bind_ip, gpus=node.gpus, env=env))
    return launches
