"""Keep secrets (HF tokens, API keys, ssh keys) out of engine processes' logs and out of results.

Engines get the user's environment minus anything that looks like a credential, unless a target
passes a named variable on purpose (the Docker target forwards HF_TOKEN to the container's env,
never to a file). Everything kvrepro writes or prints for a machine goes through ``redact``:
results files (``results.write_atomic``), the run's copy of matrix.yaml, engine logs, plans and
``--json`` output. ``redact`` masks token shapes, the values of secret-looking environment
variables and every value that was ``remember``-ed: loading a matrix remembers the values given
to secret-looking engine flags (``engine.extra_args: [--hf-token, hf_...]``), so one redaction
covers every place such a value could be copied to.

Text kvrepro did not write (a production log read by `triage`, a record copied from elsewhere)
spells secrets its own ways, and ``redact`` masks those too (issue 44): a password in a URL
(``redis://user:PW@host``), an HTTP header (``X-Api-Key: K``, ``Authorization: Bearer T``) and a
key/value pair whose key names a secret in any case (``ApiKey``, ``apiKey``, ``api_key``,
``"access-token": "..."``, ``password=...``); :func:`is_secret_key` is the same test for a key
in data (camelCase split, ``-``/``_``/``.`` alike).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable

_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL|AUTH"
                          r"|(?:^|_)KEYS?(?:$|_))", re.I)
_SECRET_VALUE = re.compile(
    r"(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16}"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----)"
)


# a flag whose value is a credential: --hf-token, --hf_token, --api-key, --ssl-keyfile-password, ...
# (vLLM's FlexibleArgumentParser takes '_' for '-' in flag names, and --a.b=... for JSON fields)
_WORDS = r"(?:key|token|secret|password|passwd|passphrase|credentials?|auth)"
# (the secret word ends the name: --hf-token, not --long-prefill-token-threshold)
_SECRET_FLAG = re.compile(r"(?:^|[-_.])" + _WORDS + r"$", re.I)
# "--hf-token VALUE" / "--hf_token=VALUE" / JSON '"--hf-token", "VALUE"' in text
_FLAG_VALUE_TEXT = re.compile(
    r"""(--[A-Za-z0-9_.-]*""" + _WORDS + r"""(?![A-Za-z0-9])['"]?"""
    r"""(?:=|\s+|['"]?,\s*['"]))(?!\*\*\*)([^\s'",\]]+)""", re.I)
# a key that names a secret, as text: api_key, ApiKey, X-Api-Key, access-token, client_secret, passwd
_KEY_NAME = (r"(?:[A-Za-z0-9]*[-_.])?(?:x[-_.])?(?:api[-_.]?key|access[-_.]?key|secret[-_.]?key|private[-_.]?key"
             r"|auth[-_.]?token|access[-_.]?token|refresh[-_.]?token|id[-_.]?token|session[-_.]?token|bearer[-_.]?token"
             r"|hf[-_.]?token|api[-_.]?token|client[-_.]?secret|secret|password|passwd|passphrase|credentials?"
             r"|authorization|proxy[-_.]?authorization)")
# KEY: VALUE, KEY=VALUE, 'KEY': 'VALUE', "KEY": "VALUE", a header's value after Bearer/Basic/Token
_KEY_VALUE_TEXT = re.compile(
    r"""(?<![A-Za-z0-9_.-])(["']?)""" + _KEY_NAME + r"""\1(\s*[:=]\s*)"""
    r"""(?:(["'])(?!\*\*\*)([^"'\n]{1,4096})\3|((?:(?:Bearer|Basic|Token)\s+)?)"""
    r"""(?!\*\*\*|(?:null|true|false|None|True|False)\b)([^\s,;'"{}\[\]()]{1,4096}))""",
    re.I)
# scheme://user:PASSWORD@host
_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]{0,31}://[^\s/@:'\"]{0,256}:)(?!\*\*\*@)([^\s/@'\"]{1,256})@")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_remembered: set[str] = set()
# option strings of `vllm serve` (normalised: no leading dashes, '_' as '-') whose destination
# names a secret, read from the release's own parser (validate.serve_flags), and how many values
# each takes (None: one; "+"/"*": every value up to the next flag)
_secret_options: dict[str, object] = {}
_all_options: set[str] = set()  # every option of those parsers (normalised), to tell prefixes apart
_lock = threading.Lock()


def _flag_name(arg: str) -> str:
    """``--hf_token=x`` -> ``hf-token``: the spelling-free name argparse matches."""
    return arg.lstrip("-").split("=", 1)[0].replace("_", "-").lower()


def register_secret_options(options: dict[str, object], all_options: list[str] | set[str] = ()) -> None:
    """Options of a release's `vllm serve` parser whose destination is a secret (option string ->
    nargs), so that every spelling the parser accepts is masked, not only the ones the pattern knows;
    ``all_options``: every option of that parser (a prefix is the parser's only when unambiguous)."""
    with _lock:
        _secret_options.update({_flag_name(k): v for k, v in options.items()})
        _all_options.update(_flag_name(k) for k in all_options if k.startswith("--"))


def registered_secret_options() -> dict[str, object]:
    """The secret options registered so far (normalised option name -> nargs), a copy."""
    with _lock:
        return dict(_secret_options)


def _registered(name: str) -> object | bool:
    with _lock:
        if name in _secret_options:
            return _secret_options[name] or True
        if not name or name in _all_options:
            return False
        # argparse (allow_abbrev, vLLM's default) takes an unambiguous prefix of a long option:
        # --hf-tok for --hf-token, --api-k for --api-key. A prefix that also starts a non-secret
        # option is ambiguous to the parser (refused), except when only secret options share it.
        hits = [v for k, v in _secret_options.items() if k.startswith(name)]
        others = [k for k in _all_options if k.startswith(name) and k not in _secret_options]
    return (hits[0] or True) if hits and not others else False


def is_secret_flag(arg: str) -> bool:
    """``--hf-token``, ``--hf_token``, ``--api-key=...``: a command-line flag whose value is a credential."""
    if not arg.startswith("--"):
        return False
    name = _flag_name(arg)
    return bool(_registered(name)) or bool(_SECRET_FLAG.search(name))


def is_secret_key(key: str) -> bool:
    """A key in data (a dict read from a log, a header name) that names a secret: ``hf_token``,
    ``api_key``, ``ApiKey``, ``apiKey``, ``X-Api-Key``, ``clientSecret``, ``password``."""
    if not key or len(key) > 200:
        return False
    snake = _CAMEL.sub("_", key)
    return is_secret_flag("--" + snake.replace("_", "-")) or re.fullmatch(_KEY_NAME, snake, re.I) is not None


def _names_a_secret(key: str) -> bool:
    """Narrower than is_secret_key, for keys of kvrepro's own records too: only the spellings
    _KEY_NAME knows (api_key, ApiKey, hf_token, password), not every ``*_key`` (overlay_key)."""
    return len(key) <= 200 and re.fullmatch(_KEY_NAME, _CAMEL.sub("_", key), re.I) is not None


def url_passwords(text: str) -> list[str]:
    """The passwords of ``scheme://user:PASSWORD@host`` URLs in ``text``."""
    return [m.group(2) for m in _URL_PASSWORD.finditer(text)]


def _takes_many(arg: str) -> bool:
    return _registered(_flag_name(arg)) in ("+", "*")


def secret_arg_values(argv: list[str]) -> list[str]:
    """The values given to secret-looking flags in an argument list (every spelling)."""
    values = []
    for i, arg in enumerate(argv):
        if not is_secret_flag(arg):
            continue
        values += _given(argv, i, many=_takes_many(arg))
    return [v for v in values if v]


def _given(argv: list[str], i: int, many: bool) -> list[str]:
    """The value(s) of the option at ``argv[i]``: after ``=``, or the next argument(s) up to the
    next option (``many``: every one, as argparse's nargs="+")."""
    arg = argv[i]
    if "=" in arg:
        return [arg.split("=", 1)[1]]
    values = []
    for value in argv[i + 1:]:
        if value.startswith("-") and len(value) > 1 and not is_number(value):
            break
        values.append(value)
        if not many:
            break
    return values


def is_number(text: str) -> bool:
    """``-1``, ``1e3``: an argument that looks like an option but is a value."""
    try:
        float(text)
        return True
    except ValueError:
        return False


def redact_args(argv: list[str]) -> list[str]:
    """argv with the values of secret-looking flags masked (for commands shown or recorded)."""
    out: list[str] = []
    masking = 0  # values still to mask: 1 after a flag, unbounded after a nargs="+" one
    for arg in argv:
        is_flag = arg.startswith("-") and len(arg) > 1 and not is_number(arg)
        if masking and not is_flag:
            out.append("***")
            masking -= 1
            continue
        masking = 0
        if is_secret_flag(arg):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=***")
            else:
                out.append(arg)
                masking = 1 << 30 if _takes_many(arg) else 1
        else:
            out.append(redact(arg))
    return out


def option_values(argv: list[str], option: str) -> list[str]:
    """The values given to ``option`` (``--api-key``) in ``argv``, in any spelling argparse takes
    (``--api_key``, ``--api-key=K``, an unambiguous prefix such as ``--api-k``), every value of a
    nargs="+" option included."""
    want = _flag_name(option)
    values: list[str] = []
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name = _flag_name(arg)
        if name != want and not (want.startswith(name) and len(name) >= len(want) - 2):
            continue
        values += _given(argv, i, many=True)
    return values


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
    text = _on_lines_with(_hits(text, ("://",)), text, _mask_url_passwords)
    text = _on_lines_with(_hits(text, _KEY_WORDS), text, lambda line: _KEY_VALUE_TEXT.sub(_masked_value, line))
    return _SECRET_VALUE.sub("***", text)


# what a line must hold for the two patterns above to match it, found with str.find (C speed), so
# that a log of megabytes is scanned once and the patterns, which may start at any word, run on
# those lines only: 10 MB of access lines took 1.5 CPU s with the patterns over the whole text
# (an IGNORECASE alternation alone takes 0.5 s), 0.05 s this way
_KEY_WORDS = ("key", "token", "secret", "passw", "passphrase", "credential", "authorization")
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")  # keeps every index


def _hits(text: str, words: tuple[str, ...]) -> list[int]:
    low = text.translate(_ASCII_LOWER)
    found = []
    for word in words:
        i = low.find(word)
        while i >= 0:
            found.append(i)
            i = low.find(word, i + 1)
    return sorted(found)


def _mask_url_passwords(line: str) -> str:
    return _URL_PASSWORD.sub(lambda m: m.group(1) + "***@", line)


def _on_lines_with(hits: list[int], text: str, change: Callable[[str], str]) -> str:
    """``text`` with ``change`` applied to each line that holds one of ``hits`` (positions)."""
    parts: list[str] = []
    done = 0
    for at in hits:
        if at < done:
            continue  # on a line already changed
        start = text.rfind("\n", 0, at) + 1
        end = text.find("\n", at)
        end = len(text) if end < 0 else end
        parts += [text[done:start], change(text[start:end])]
        done = end
    if not parts:
        return text
    parts.append(text[done:])
    return "".join(parts)


def _masked_value(m: re.Match[str]) -> str:
    whole = m.group(0)
    if m.group(4) is not None:  # a quoted value: keep its quotes
        start, end = m.span(4)
    else:
        start, end = m.span(6)
    base = m.start(0)
    return whole[:start - base] + "***" + whole[end - base:]


def redact_value(value, key: str = ""):
    """A JSON-like value (dicts, lists, strings) with every string redacted, and every value under
    a key that names a secret (``ApiKey``, ``hf_token``: :func:`is_secret_key`) masked whole."""
    if key and value not in (None, "", False, True, "***") and not isinstance(value, (dict, list, tuple)) \
            and _names_a_secret(key):
        return "***"
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_value(v, k if isinstance(k, str) else "") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_value(v, key) for v in value]
    return value
