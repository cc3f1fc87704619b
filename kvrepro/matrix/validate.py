"""Everything about a matrix that can be checked without starting an engine.

``spec.parse_matrix`` checks the file's shape (types, ranges, known patches, duplicate keys).
This module checks what needs the rest of kvrepro: that the target and the load profile exist,
that the model can be found, that every patch file is there with its sha256, and that every
flag in ``engine.extra_args`` is one the base release's own ``vllm serve`` knows. It runs before
``matrix run`` creates a run folder, so a typo costs a second, not an engine start, and leaves
nothing behind.

The engine flags are read from vLLM's own argument parser (``vllm serve``'s subcommand parser,
built by ``make_arg_parser``) in the runtime env with the base's pristine ``vllm/`` on
PYTHONPATH; the flag list is cached per wheel (``$KVREPRO_HOME/serve-flags/``), so only the first
check of a release pays for importing vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from .. import paths, versions
from ..errors import SpecError
from ..secrets import (is_number, redact, register_secret_options, registered_secret_options, remember,
                       scrubbed_environ, secret_arg_values)
from ..spec.matrix import LoadedMatrix, expected_defects
from ..spec.yamltext import line_for, line_index
from ..loadgen import known_profiles
from ..deploy import check_environment


def _where(loaded: LoadedMatrix, dotted: str, lines: dict) -> str:
    line = line_for(lines, tuple(dotted.split(".")))
    return f"{loaded.path}:{line}" if line else str(loaded.path)


def serve_flags(base: str, on_line: Callable[[str], None] | None = None) -> set[str] | None:
    """The option strings of vLLM ``base``'s `vllm serve`, or None if the runtime env or the
    wheel are not set up yet (`kvrepro setup` makes them; nothing is downloaded here)."""
    from ..builds import is_ready, vllm_requirements
    from ..builds.overlay import pristine_tree
    from ..builds.wheel import cached_wheel

    wheel = cached_wheel(base)
    if wheel is None or not is_ready(vllm_requirements(wheel)):
        return None
    _, tree, digest = pristine_tree(base)
    cache = paths.home() / "serve-flags" / f"{base}-{digest[:12]}.json"
    secrets_cache = cache.with_name(f"{base}-{digest[:12]}.secret-options.json")
    try:
        flags = json.loads(cache.read_text())
        _register_secret_options(json.loads(secrets_cache.read_text()), flags)
        return set(flags)
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    from ..builds import prepare_runtime
    runtime = prepare_runtime(base)  # ready (checked above): nothing is installed here
    if on_line:
        on_line(f"reading vLLM {base}'s `vllm serve` flags (once per release)")
    env = scrubbed_environ()
    env.update(PYTHONPATH=runtime.pythonpath(tree), VLLM_LOGGING_LEVEL="ERROR",
               PYTHONPYCACHEPREFIX=str(paths.pycache_prefix()))
    try:
        proc = subprocess.run([str(runtime.python), "-c", versions.SERVE_FLAGS_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=300, cwd=str(tree))
    except (OSError, subprocess.TimeoutExpired):
        return None
    marker = [ln for ln in proc.stdout.splitlines() if ln.startswith("KVREPRO-FLAGS ")]
    secret_marker = [ln for ln in proc.stdout.splitlines() if ln.startswith("KVREPRO-SECRET-OPTIONS ")]
    if proc.returncode != 0 or not marker:
        return None
    flags = json.loads(marker[-1].removeprefix("KVREPRO-FLAGS "))
    secret_options = json.loads(secret_marker[-1].removeprefix("KVREPRO-SECRET-OPTIONS ")) if secret_marker else {}
    _register_secret_options(secret_options, flags)
    try:
        from ..results.store import write_atomic

        write_atomic(secrets_cache, json.dumps(secret_options, sort_keys=True) + "\n")
        write_atomic(cache, json.dumps(flags) + "\n")
    except OSError:  # a read-only cache only costs the next check its time
        pass
    return set(flags)


def _register_secret_options(options: dict, flags: list[str]) -> None:
    """The release's secret options (``--hf-token``, ``--api-key``, ...: destinations naming a
    secret) join the ones kvrepro masks in every spelling (kvrepro/secrets.py)."""
    if not isinstance(options, dict) or not isinstance(flags, list):
        raise TypeError("not a mapping and a list")
    register_secret_options(options, flags)


def secret_options(base: str) -> dict | None:
    """The options of vLLM ``base``'s `vllm serve` whose destination names a secret (option ->
    nargs), read from its own parser; None when the runtime env is not set up."""
    if serve_flags(base) is None:
        return None
    return registered_secret_options()


def unknown_flags(args: list[str], known: set[str]) -> list[str]:
    """The flags in ``args`` that `vllm serve` does not know (values and numbers are skipped)."""
    unknown = []
    for arg in args:
        if not arg.startswith("-") or arg == "-" or is_number(arg):
            continue
        flag = arg.split("=", 1)[0]
        # FlexibleArgumentParser takes --max_num_seqs for --max-num-seqs and --x.y=... for JSON args
        candidates = {flag, flag.replace("_", "-"), flag.split(".", 1)[0], flag.split(".", 1)[0].replace("_", "-")}
        if not candidates & known:
            unknown.append(flag)
    return unknown


def check(loaded: LoadedMatrix, target: str | None = None, engine_flags: bool = True,
          on_line: Callable[[str], None] | None = None) -> list[str]:
    """Raise SpecError listing every problem (file:line: field: what to do); return notes about
    what could not be checked (e.g. engine flags before `kvrepro setup`)."""
    from ..deploy import known_targets
    m = loaded.matrix
    lines = line_index(loaded.text)
    problems: list[str] = []
    notes: list[str] = []
    target_name = target or m.target
    targets = known_targets()
    if target_name not in targets:
        where = "--target" if target else f"{_where(loaded, 'target', lines)}: target"
        problems.append(f"{where}: unknown target {target_name!r}; known targets: {', '.join(targets)}")
    else:
        try:  # what the target takes from the environment ($RAY_ADDRESS), as bad input before a run folder
            check_environment(target_name, m)
        except SpecError as exc:
            problems.append(str(exc))
    profiles = sorted(known_profiles())
    if m.load.profile not in profiles:
        problems.append(f"{_where(loaded, 'load.profile', lines)}: load.profile: unknown profile {m.load.profile!r}; "
                        f"known profiles: {', '.join(profiles)} (one file each under kvrepro/loadgen/profiles/)")
    from ..classify.corruption import UNKNOWN, known_corruptions
    defects = {c.name for c in known_corruptions()} | {UNKNOWN}
    for build, expect in m.expect.items():
        for alternative in expect.split("|"):
            for defect in expected_defects(alternative):
                if defect not in defects:
                    problems.append(f"{_where(loaded, f'expect.{build}', lines)}: expect.{build}: unknown defect "
                                    f"{defect!r}; known: {', '.join(sorted(defects))} (`kvrepro signatures`)")
    problem = _model_problem(loaded, target_name)
    if problem:
        problems.append(f"{_where(loaded, 'engine.model', lines)}: engine.model: {problem}")
    try:
        loaded.plans()  # every patch file exists and matches its sha256
    except SpecError as exc:
        problems.append(str(exc))
    for name, patch in m.patches.items():
        if patch.outside_matrix_folder:
            notes.append(f"patches.{name}.file: {patch.file} is read from outside the matrix's folder "
                         "(outside_matrix_folder: true)")
    if m.engine.extra_args:
        # reading the parser also registers its secret options (every spelling gets masked)
        known = {base: serve_flags(base, on_line) for base in m.bases}[m.bases[0]]
        remember(secret_arg_values(list(m.engine.extra_args)))
    if engine_flags and m.engine.extra_args:
        if known is None:
            notes.append(f"engine.extra_args not checked against vLLM {m.base}'s `vllm serve` "
                         "(run `kvrepro setup` first)")
        else:
            bad = unknown_flags(list(m.engine.extra_args), known)
            if bad:
                problems.append(
                    f"{_where(loaded, 'engine.extra_args', lines)}: engine.extra_args: `vllm serve` of vLLM {m.base} "
                    f"does not know {', '.join(redact(b) for b in bad)}; see `vllm serve --help` of that release")
    if problems:
        raise SpecError("invalid matrix:\n  " + "\n  ".join(problems))
    return notes


def _model_problem(loaded: LoadedMatrix, target: str) -> str | None:
    name = loaded.matrix.engine.model
    try:
        loaded.model_dir()
        return None
    except SpecError as exc:
        message = str(exc).split("engine.model: ", 1)[-1]
    looks_like_hub_id = (name.count("/") == 1 and not name.startswith((".", "/", "~"))
                         and not Path(os.path.expanduser(name)).exists())
    from ..deploy import fetches_hub_models, known_targets

    if fetches_hub_models(target) and looks_like_hub_id:
        return None  # a Hugging Face id: vLLM fetches it inside the container (not checkable offline)
    if looks_like_hub_id:
        fetching = ", ".join(t for t in known_targets() if fetches_hub_models(t)) or "none"
        return (f"{message}; the {target} target needs a local folder with config.json "
                f"(Hugging Face ids only work with a target that fetches them: {fetching})")
    return message + "; give a folder with config.json (relative to matrix.yaml) or a shipped name"


__all__ = ["check", "serve_flags", "unknown_flags"]
