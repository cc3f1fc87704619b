"""The `docker` engine on another target's nodes (``ray.engine: docker``): the hooks of
:class:`kvrepro.deploy.base.NodeEngine`, found by ``NODE_ENGINE`` in this package's __init__.

The driver keeps each build's patch files (a few kB, sent with every run); a node finds or makes
the build's image in its own Docker daemon with this target's own code (assemble.py), and runs
the engine as a container there. The transport (how runs and files reach a node) is the other
target's.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...errors import BadInputError, KvreproError
from ...builds.records import BuildArtifact
from ...spec.records import BuildPlan
from ..base import NodeBuild, ShippedFile
from .settings import docker_settings


def check_for_nodes(loaded: Any) -> None:
    """Each engine runs in its node's own daemon: a ``hosts:`` list (or ``docker.nodes``) would name
    other daemons, which the nodes do not use; one line, not a surprise."""
    settings = docker_settings(loaded.matrix)
    if settings.hosts or settings.docker.nodes:
        raise BadInputError("ray.engine docker: every node runs its engine in its own Docker daemon; remove hosts: "
                            "and docker.nodes from matrix.yaml (they are the docker target's)")


def prepare_for_nodes(plan: BuildPlan, artifact: BuildArtifact) -> NodeBuild:
    """The build's patch files: a node makes the image from the base image and these
    (:func:`node_artifact`); no overlay travels."""
    return NodeBuild(files=tuple(ShippedFile(sha256=hashlib.sha256(data).hexdigest(), data=data)
                                 for data in (p.path.read_bytes() for p in plan.patches)))


def node_artifact(target: Any, artifact: BuildArtifact, build: NodeBuild, cache: Path, where: str) -> BuildArtifact:
    """The build's image in this node's own Docker daemon (DOCKER_HOST on the node, else its
    socket), by the docker target's own ``prepare`` (assemble.py); ``target`` is the docker target
    made on the node, ``cache`` the node's folder.

    Its tag is content-addressed (base image id + patches + probe): present, it is used as it is;
    absent, it is made here once, ``FROM`` the base image in this daemon plus the patched files.
    That is what the docker code does on every host, so the node needs only the base image and
    the build's patch files (sent with the run, a few kB), never a multi-GB image tarball through
    the object store. Two runs needing the same tag at once take a file lock per daemon and tag
    (``<kvrepro home>/docker/locks``): the second finds the image made by the first. Nodes on one
    machine share that machine's daemon and so the lock.
    """
    if not artifact.ok:
        return artifact
    from .assemble import assembly_key, docker_dir, find_base, image_tag, safe_tag_part
    from .hosts import local_host_spec

    folder = cache / "patches"
    folder.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for patch in build.files:
        path = folder / f"{patch.sha256}.patch"  # named by its content: any run's copy is the same
        if not path.is_file():
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            tmp.write_bytes(patch.data)
            os.replace(tmp, path)
        paths.append(path)
    plan = replace(artifact.plan, patches=tuple(replace(ref, path=path)
                                                for ref, path in zip(artifact.plan.patches, paths)))
    try:
        host = target.host(local_host_spec())
        settings = target.settings
        base = find_base(host, settings.image_for(plan.base), settings.docker.pull)
    except KvreproError as exc:
        return replace(artifact, ref=None, error=f"node {where}: {exc}")
    tag = image_tag(plan.base, assembly_key(base, plan))
    locks = docker_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{safe_tag_part(str(host.info.get('ID') or host.name))}-{safe_tag_part(tag)}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return target.prepare(plan)


def remove_left_behind(driver: str) -> list[str]:
    """On a node, once every run ``driver`` sent it has ended: remove the engine containers of
    those runs still in this node's daemon; their names.

    A run's task removes its own containers when it is cancelled, but one whose teardown outlasts
    ``ray.cancel_grace_s`` (a loaded machine: vLLM's stop, the log pump, the removal) has its
    worker killed mid-way, and Ray kills the worker's children with it, the session's reaper
    (reaper.py) among them. The driver calls this on its nodes before it exits, so nothing
    started is left running whichever way its runs ended."""
    from . import labels as L
    from .hosts import connect, local_host_spec, remove_quietly

    if not driver:
        return []
    host = connect(local_host_spec(), timeout=20)
    try:
        found = host.client.containers.list(all=True, filters={"label": f"{L.LABEL_DRIVER}={driver}"},
                                            ignore_removed=True)
        for container in found:
            remove_quietly(container)
        return [c.name for c in found]
    finally:
        host.close()
