"""Keep secrets (HF tokens, API keys, ssh keys) out of engine processes' logs and out of results.

Engines get the user's environment minus anything that looks like a credential, unless a target
passes a named variable on purpose (the Docker target forwards HF_TOKEN to the container's env,
never to a file). Everything kvrepro writes or prints for a machine goes through ``redact``:
results files (``results.write_atomic``), the run's copy of matrix.yaml, engine logs, plans and
``--json`` output. ``redact`` masks token shapes, the values of secret-looking environment
variables and every value that was ``remember``-ed: loading a matrix remembers the values given
to secret-looking engine flags (``engine.extra_args: [--hf-token, hf_...]``), so one redaction
covers every place such a value could be copied to.
"""

from __future__ import annotations

import os
import re
import threading

_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL|AUTH)", re.I)
_SECRET_VALUE = re.compile(
    r"(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16}"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----)"
)


# a flag whose value is a credential: --hf-token, --api-key, --ssl-keyfile-password, ...
_SECRET_FLAG = re.compile(r"(?:^|-)(?:key|token|secret|password|passwd|credentials?|auth)(?:$|-)", re.I)
# "--hf-token VALUE" / "--hf-token=VALUE" / JSON '"--hf-token", "VALUE"' in text
_FLAG_VALUE_TEXT = re.compile(
    r"""(--[A-Za-z0-9-]*(?:key|token|secret|password|passwd|credentials?|auth)(?![A-Za-z0-9])['"]?"""
    r"""(?:=|\s+|['"]?,\s*['"]))(?!\*\*\*)([^\s'",\]]+)""", re.I)
_remembered: set[str] = set()
_lock = threading.Lock()


def is_secret_flag(arg: str) -> bool:
    """``--hf-token``, ``--api-key=...``: a command-line flag whose value is a credential."""
    return arg.startswith("--") and bool(_SECRET_FLAG.search(arg[2:].split("=", 1)[0]))


def secret_arg_values(argv: list[str]) -> list[str]:
    """The values given to secret-looking flags in an argument list."""
    values = []
    for i, arg in enumerate(argv):
        if not is_secret_flag(arg):
            continue
        if "=" in arg:
            values.append(arg.split("=", 1)[1])
        elif i + 1 < len(argv):
            values.append(argv[i + 1])
    return [v for v in values if v]


def redact_args(argv: list[str]) -> list[str]:
    """argv with the values of secret-looking flags masked (for commands shown or recorded)."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next:
            out.append("***")
            mask_next = False
        elif is_secret_flag(arg):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=***")
            else:
                out.append(arg)
                mask_next = True
        else:
            out.append(redact(arg))
    return out


def remember(values: list[str]) -> None:
    """Values ``redact`` masks from now on in this process (wherever they turn up)."""
    with _lock:
        _remembered.update(v for v in values if v and len(v) >= 4)


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def scrubbed_environ(base: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment without credential-looking variables."""
    env = dict(os.environ if base is None else base)
    return {k: v for k, v in env.items() if not is_secret_name(k)}


def redact(text: str, extra_values: list[str] | None = None) -> str:
    """Replace known token shapes, and the current values of secret env vars, by ``***``."""
    values = [v for k, v in os.environ.items() if is_secret_name(k) and len(v) >= 8]
    with _lock:
        values += list(_remembered)
    for value in sorted(set(values + (extra_values or [])), key=len, reverse=True):
        if value:
            text = text.replace(value, "***")
    text = _FLAG_VALUE_TEXT.sub(lambda m: m.group(1) + "***", text)
    return _SECRET_VALUE.sub("***", text)


def redact_value(value):
    """A JSON-like value (dicts, lists, strings) with every string redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_value(v) for v in value]
    return value
