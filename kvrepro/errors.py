"""Errors kvrepro reports to the user, each with an exit code and no traceback."""

from __future__ import annotations


class KvreproError(Exception):
    """Base: a message meant for a person, and the process exit code to use."""

    exit_code = 1


class BadInputError(KvreproError):
    """An argument or an input file is wrong (a folder where a file belongs, a damaged record)."""

    exit_code = 2


class SpecError(BadInputError):
    """matrix.yaml is wrong: the message names file:line, the field and what is allowed."""


class SetupError(KvreproError):
    """The runtime env, a wheel download or the Docker daemon could not be set up."""

    exit_code = 3


class InfraError(KvreproError):
    """A build or an engine start failed: the run is INFRA, the matrix goes on."""

    exit_code = 3


def describe_os_error(exc: OSError) -> str:
    """One line for an OSError that reached the top: which file, what happened, what to do."""
    import errno

    where = exc.filename or "a file"
    what = exc.strerror or str(exc)
    hint = {
        errno.ENOSPC: "free some space (or point --results / $KVREPRO_HOME elsewhere) and run again",
        errno.EDQUOT: "free some space (or point --results / $KVREPRO_HOME elsewhere) and run again",
        errno.EROFS: "the file system is read-only: point --results (or $KVREPRO_HOME for the caches) at a writable folder",
        errno.EACCES: "no permission: point --results (or $KVREPRO_HOME for the caches) at a folder you can write",
        errno.EPERM: "no permission: point --results (or $KVREPRO_HOME for the caches) at a folder you can write",
        errno.ENOTDIR: "a file stands where a folder is needed: move it or choose another path",
        errno.EEXIST: "a file stands where a folder is needed: move it or choose another path",
    }.get(exc.errno or 0, "check the path and run again")
    return f"{where}: {what}; {hint}"
