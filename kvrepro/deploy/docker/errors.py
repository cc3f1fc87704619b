"""The named ways a docker run fails before the code under test is reached.

Each is an InfraError, so the runner records that run as INFRA (the matrix goes on) and the CLI
prints the message without a traceback. The message says what was tried and what to do.
"""

from __future__ import annotations

from ...errors import InfraError


class DockerInfraError(InfraError):
    """Base of the docker target's errors; ``kind`` is a stable name for results and tests."""

    kind = "docker"


class DaemonDownError(DockerInfraError):
    kind = "daemon_down"


class SshError(DaemonDownError):
    """The ssh connection to a host failed; the message carries ssh's own reason."""

    kind = "ssh"


class UnknownHostError(DockerInfraError):
    kind = "unknown_host"


class PortInUseError(DockerInfraError):
    kind = "port_in_use"


class EngineNeverHealthyError(DockerInfraError):
    kind = "engine_never_healthy"


class ImageMissingError(DockerInfraError):
    kind = "image_missing"


class ImageBuildError(DockerInfraError):
    """Assembling a build's image failed: the message names the step (and the patch, if one)."""

    kind = "image_build"


class ContainerError(DockerInfraError):
    """The daemon refused to create or start a container for another reason."""

    kind = "container"


class EngineStartCancelled(DockerInfraError):
    """Ctrl-C (Target.interrupt) arrived while an engine was still starting."""

    kind = "interrupted"
