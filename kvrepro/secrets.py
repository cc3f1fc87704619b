"""Keep secrets (HF tokens, API keys, ssh keys) out of engine processes' logs and out of results.

Engines get the user's environment minus anything that looks like a credential, unless a target
passes a named variable on purpose (the Docker target forwards HF_TOKEN to the container's env,
never to a file). Text we store (manifests, commands, error messages) goes through ``redact``.
"""

from __future__ import annotations

import os
import re

_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL|AUTH)", re.I)
_SECRET_VALUE = re.compile(
    r"(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16}"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----)"
)


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def scrubbed_environ(base: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment without credential-looking variables."""
    env = dict(os.environ if base is None else base)
    return {k: v for k, v in env.items() if not is_secret_name(k)}


def redact(text: str, extra_values: list[str] | None = None) -> str:
    """Replace known token shapes, and the current values of secret env vars, by ``***``."""
    values = [v for k, v in os.environ.items() if is_secret_name(k) and len(v) >= 8]
    for value in sorted(set(values + (extra_values or [])), key=len, reverse=True):
        text = text.replace(value, "***")
    return _SECRET_VALUE.sub("***", text)
