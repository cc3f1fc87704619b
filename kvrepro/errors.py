"""Errors kvrepro reports to the user, each with an exit code and no traceback."""

from __future__ import annotations


class KvreproError(Exception):
    """Base: a message meant for a person, and the process exit code to use."""

    exit_code = 1


class SpecError(KvreproError):
    """matrix.yaml is wrong: the message names file:line, the field and what is allowed."""

    exit_code = 2


class SetupError(KvreproError):
    """The runtime env, a wheel download or the Docker daemon could not be set up."""

    exit_code = 3


class InfraError(KvreproError):
    """A build or an engine start failed: the run is INFRA, the matrix goes on."""

    exit_code = 3
