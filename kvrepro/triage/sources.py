"""Where a pasted report says which vLLM ran and how it was configured.

A production log states both in vLLM's own lines (the banner, ``non-default args``; read by
:mod:`.deployed`). A report on a tracker more often carries them elsewhere: the command
(``vllm serve ...``, ``python -m vllm.entrypoints.openai.api_server ...`` over several lines,
with or without backslashes; ``docker run ... vllm/vllm-openai:v0.26.0 ...``; a pod's
``args:`` list or ``kubectl describe``'s ``Command:``/``Args:``), a JSON connector config, an
``LLM(...)``/``EngineArgs(...)`` call, flags quoted in prose, ``collect_env``/``pip list``/``pip
freeze`` output, an image tag, a wheel's file name, an environment list (``- vLLM: 0.22.1``).

Everything here is read as data: command lines are split with :mod:`shlex` and connector configs
parsed with :mod:`json`; a Python call is parsed with :mod:`ast` and only literal keyword values
are taken (``tensor_parallel_size=tp`` names a variable: not read). Only the flags triage uses
are interpreted (:data:`FLAGS`); each value keeps the line it came from.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# a version or a command is in the first this many characters of its line (a longer line is read so far)
MAX_SOURCE_LINE = 8192

# -- versions, most trusted first ----------------------------------------------------------------
_VERSION = r"v?(?P<v>\d+\.\d+\.\d+(?:\.?(?:dev|post|rc|a|b)\d+|\+[\w.]+)*)"
VERSION_SOURCES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("the API server's banner", re.compile(r"vLLM API server version " + _VERSION)),
    ("the engine's start-up line", re.compile(r"Initializing an? (?:V1 )?LLM engine \(" + _VERSION + r"\)")),
    ("the engine's input dump", re.compile(r"Dumping input data for V1 LLM engine \(" + _VERSION + r"\)")),
    ("collect_env output", re.compile(r"^\s*vLLM Version\s*:\s*" + _VERSION)),
    ("pip freeze output", re.compile(r"^\s*(?:\[pip\d?\]\s*)?vllm\s*==\s*" + _VERSION + r"\s*$")),
    ("pip list output", re.compile(r"^\s*vllm\s{2,}" + _VERSION + r"(?:\s|$)")),
    ("the docker image tag", re.compile(r"\bvllm-openai(?:-[\w]+)?:" + _VERSION)),
    ("a wheel's file name", re.compile(r"\bvllm-" + _VERSION + r"(?:-[\w.-]+\.whl|\.dist-info)")),
    # one character class between the name and the number: no two runs of spaces can trade characters
    ("an environment line", re.compile(r"^[\s>*|`-]*vllm(?:[*`]*\s+version|\.__version__)?[\s:=*`]*" + _VERSION
                                       + r"[*`]*(?:\s+\(.*\))?\s*$", re.IGNORECASE)),
)
PIP_SHOW_RANK = 4  # `pip show vllm` ranks with pip's other outputs
_NIGHTLY = re.compile(r"\bvllm-openai:(?P<tag>nightly[\w.-]*|latest)\b")


def find_version(text: str) -> tuple[str, int, str] | None:
    """(version, rank (0 most trusted), what said it) of the first source on the line, or None."""
    if "llm" not in text[:MAX_SOURCE_LINE].lower():
        return None
    text = text[:MAX_SOURCE_LINE]
    for rank, (what, rx) in enumerate(VERSION_SOURCES):
        if (m := rx.search(text)) is not None:
            return m["v"], rank, what
    return None


def nightly_image(text: str) -> str | None:
    """A ``vllm/vllm-openai:nightly-...`` (or ``:latest``) image named on the line: a build whose
    release the tag does not say."""
    m = _NIGHTLY.search(text) if "vllm-openai:" in text else None
    return m["tag"] if m else None


# -- command lines ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    key: str  # vLLM's argument name, as `non-default args` prints it
    kind: str  # int, float, str, json, bool (a switch), nobool (its --no- form)


FLAGS: dict[str, Flag] = {
    "--tensor-parallel-size": Flag("tensor_parallel_size", "int"), "-tp": Flag("tensor_parallel_size", "int"),
    "--data-parallel-size": Flag("data_parallel_size", "int"), "-dp": Flag("data_parallel_size", "int"),
    "--pipeline-parallel-size": Flag("pipeline_parallel_size", "int"), "-pp": Flag("pipeline_parallel_size", "int"),
    "--enable-prefix-caching": Flag("enable_prefix_caching", "bool"),
    "--no-enable-prefix-caching": Flag("enable_prefix_caching", "nobool"),
    "--mamba-cache-mode": Flag("mamba_cache_mode", "str"),
    "--block-size": Flag("block_size", "int"),
    "--kv-offloading-size": Flag("kv_offloading_size", "float"),
    "--kv-offloading-backend": Flag("kv_offloading_backend", "str"),
    "--kv-transfer-config": Flag("kv_transfer_config", "json"),
    "--speculative-config": Flag("speculative_config", "json"),
    "--scheduling-policy": Flag("scheduling_policy", "str"),
    "--model": Flag("model", "str"),
}
_COMMAND_START = re.compile(r"\bvllm\s+serve\b|\bvllm\.entrypoints\.[\w.]+|\bapi_server\.py\b"
                            r"|\bdocker\s+run\b|vllm-openai[:\s]")
# the programs a report runs vLLM's image with (`docker run ... vllm/vllm-openai:v0.26.0 ...`): words
# in a pasted command, not kvrepro's docker target
CONTAINER_CLIS = frozenset({"docker", "podman", "nerdctl"})
_IMAGE = re.compile(r"(?:^|/)vllm-openai(?::\S*)?$")
_EDGE = "`*'\""
_MODEL = re.compile(r"^[\w~/.][\w./:@+-]*[\w]$")


def _canonical_flag(word: str) -> str:
    """``--max_num_seqs`` -> ``--max-num-seqs``; a unique prefix of a flag triage reads (argparse
    takes ``--tensor-parallel 2``) -> that flag."""
    if word.startswith("--"):
        word = "--" + word[2:].replace("_", "-")
    if word in FLAGS or not word.startswith("--"):
        return word
    longer = [f for f in FLAGS if f.startswith(word)]
    return longer[0] if len(longer) == 1 and len(word) >= 8 else word


def split_command(text: str) -> list[str]:
    """Tokens of a command line, as a shell would split it; a line whose quotes do not close (cut
    by the paste) is split on whitespace instead."""
    try:
        return shlex.split(text, comments=False, posix=True)
    except ValueError:
        return text.split()


def parse_flags(tokens: Sequence[str], positional_model: bool = False) -> tuple[dict[str, Any], list[str]]:
    """(args by vLLM's names, problems) from command-line tokens. Only :data:`FLAGS` are taken; a
    value that does not parse (a number, JSON) is a problem, not a value. ``positional_model``:
    a first bare word is the model (``vllm serve MODEL``, a pod's ``args:`` list)."""
    args: dict[str, Any] = {}
    problems: list[str] = []
    words = [t.strip(_EDGE) for t in tokens]
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("-"):
            if positional_model and i == 1 and _MODEL.match(word):
                args["model_tag"] = word
            continue
        name, eq, value = word.partition("=")
        name, dot, sub = name.partition(".")
        name = _canonical_flag(name)
        flag = FLAGS.get(name)
        if flag is None or (dot and flag.kind != "json"):
            continue
        if flag.kind in ("bool", "nobool"):
            args[flag.key] = (flag.kind == "bool") if not eq else value.lower() in ("1", "true", "yes")
            continue
        if not eq:
            if i >= len(words) or (words[i].startswith("-") and not words[i][1:2].isdigit()):
                problems.append(f"{name} has no value")
                continue
            value = words[i]
            i += 1
        if dot:
            nested = args.setdefault(flag.key, {})
            if isinstance(nested, dict):
                nested[sub] = _scalar(value)
            continue
        parsed, problem = _convert(flag, value)
        if problem:
            problems.append(f"{name}: {problem}")
        else:
            args[flag.key] = parsed
    return args, problems


def _scalar(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def _convert(flag: Flag, value: str) -> tuple[Any, str | None]:
    if flag.kind == "int":
        if len(value) > 4000 and value.lstrip("+-").isdigit():  # int() refuses more than 4,300 digits
            return None, f"a number of {len(value):,} digits is not a {flag.key}"
        try:
            return int(value), None
        except ValueError:
            return None, f"{value[:40]!r} is not a number"
    if flag.kind == "float":
        try:
            return float(value), None
        except ValueError:
            return None, f"{value[:40]!r} is not a number"
    if flag.kind == "json":
        try:
            data = json.loads(value)
        except ValueError as exc:
            return None, f"not JSON ({getattr(exc, 'msg', exc)} at column {getattr(exc, 'colno', '?')})"
        except RecursionError:
            return None, "not JSON (nested too deep)"
        if not isinstance(data, dict):
            return None, "not a JSON object"
        return data, None
    return value, None


# -- the shapes a command takes in a report ------------------------------------------------------
@dataclass(frozen=True)
class Found:
    """Args read from one source: its first line and what it was."""

    line: int
    what: str
    args: dict[str, Any]
    problems: tuple[str, ...] = ()


def read_text(numbered: Sequence[tuple[int, str]]) -> list[Found]:
    """Every source of configuration in a pasted text (command lines over one or more lines, args
    lists, JSON connector configs, engine-argument calls, flags quoted in prose)."""
    found: list[Found] = []
    used: set[int] = set()
    texts = [t[:MAX_SOURCE_LINE] for _, t in numbered]
    for idx, (number, _) in enumerate(numbered):
        if idx in used:
            continue
        text = texts[idx]
        lower = text.lower()
        for reader, cue in ((_command, ("vllm", "api_server", "docker")), (_arg_list, ("args", "command")),
                            (_json_block, ("{",)), (_call, ("llm(", "engineargs("))):
            if not any(c in lower for c in cue):
                continue  # the regexes run only where their words are: a big text is mostly other lines
            hit = reader(texts, idx, number)
            if hit is not None:
                span, item = hit
                used.update(range(idx, idx + span))
                if item.args or item.problems:
                    found.append(item)
                break
        else:
            if "--" in text and any(f in text.replace("_", "-") for f in FLAGS if f.startswith("--")):
                args, problems = parse_flags(split_command(text.replace("`", " ")))
                if args or problems:
                    found.append(Found(number, "flags quoted in the text", args, tuple(problems)))
    return found


def _command(texts: list[str], idx: int, number: int) -> tuple[int, Found] | None:
    text = texts[idx]
    m = _COMMAND_START.search(text)
    if m is None:
        return None
    parts = [text.rstrip()]
    j = idx + 1
    while j < len(texts) and len(parts) < 200:
        prev, nxt = parts[-1], texts[j].strip()
        if prev.endswith("\\") or nxt.startswith("--") or re.match(r"^-[a-z]{1,3}(?:\s|=|$)", nxt):
            parts[-1] = prev.rstrip("\\").rstrip()
            parts.append(nxt)
            j += 1
            continue
        break
    tokens = split_command(" ".join(parts).replace("`", " "))
    what, rest = _after_program(tokens)
    if what is None:
        return None
    args, problems = parse_flags(rest, positional_model=what in ("vllm serve", "the docker command"))
    return j - idx, Found(number, what, args, tuple(problems))


def _after_program(tokens: list[str]) -> tuple[str | None, list[str]]:
    for i, token in enumerate(tokens):
        if token == "serve" and i and tokens[i - 1].endswith("vllm"):
            return "vllm serve", tokens[i + 1:]
        if token.startswith("vllm.entrypoints.") or token.endswith("api_server.py"):
            return "the API server command", tokens[i + 1:]
        if _IMAGE.search(token.split("@", 1)[0]) and (i == 0 or (
                "run" in tokens[:i] and any(t.rsplit("/", 1)[-1] in CONTAINER_CLIS for t in tokens[:i]))):
            return "the docker command", tokens[i + 1:]  # the image's entrypoint is `vllm serve`
    return None, []


_LIST_KEY = re.compile(r"^(\s*)(?:-\s+)?(?P<key>args|Args|command|Command)\s*:\s*(?P<inline>.*)$")
_ITEM = re.compile(r"^\s*-\s+(?P<item>.*)$")


def _arg_list(texts: list[str], idx: int, number: int) -> tuple[int, Found] | None:
    """A pod spec's ``args:`` (YAML items) or ``kubectl describe``'s ``Command:``/``Args:`` (one
    token a line): the image's entrypoint is ``vllm serve``."""
    m = _LIST_KEY.match(texts[idx])
    if m is None or m["inline"].strip() not in ("", "|", ">"):
        return None
    indent = len(m[1])
    tokens: list[str] = []
    j = idx + 1
    while j < len(texts):
        line = texts[j]
        stripped = line.strip()
        if not stripped:
            break
        if len(line) - len(line.lstrip()) <= indent and not _ITEM.match(line):
            nxt = _LIST_KEY.match(line)
            if nxt is not None and m["key"] == "Command" and nxt["key"] == "Args":
                j += 1  # kubectl describe's Command: then Args: -- one command line
                continue
            break
        item = _ITEM.match(line)
        value = (item["item"] if item else stripped)
        value = _strip_comment(value)
        tokens.extend(split_command(value))
        j += 1
    if not tokens:
        return None
    joined = " ".join(tokens)
    if "serve" in tokens and "vllm" in tokens:
        what, rest = _after_program(tokens)
        args, problems = parse_flags(rest, positional_model=True)
        return j - idx, Found(number, f"the pod's {m['key']} list ({what})", args, tuple(problems))
    if not any(t.startswith("--") for t in tokens) and "vllm" not in joined:
        return None
    args, problems = parse_flags(tokens, positional_model=True)
    return j - idx, Found(number, f"the pod's {m['key']} list", args, tuple(problems))


def _strip_comment(value: str) -> str:
    out, quote = [], ""
    for i, ch in enumerate(value):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or value[i - 1].isspace()):
            break
        out.append(ch)
    return "".join(out).strip()


def _balanced_span(texts: list[str], idx: int, start: int, opening: str, closing: str,
                   limit: int) -> tuple[int, str] | None:
    """(lines used, text) from ``texts[idx][start:]`` until the brackets balance, outside strings."""
    depth, quote, chunks = 0, "", []
    for j in range(idx, min(len(texts), idx + limit)):
        line = texts[j][start:] if j == idx else texts[j]
        for k, ch in enumerate(line):
            if quote:
                if ch == quote and line[k - 1:k] != "\\":
                    quote = ""
            elif ch in "'\"":
                quote = ch
            elif ch == opening:
                depth += 1
            elif ch == closing:
                depth -= 1
                if depth == 0:
                    chunks.append(line[:k + 1])
                    return j - idx + 1, "\n".join(chunks)
        chunks.append(line)
        quote = ""  # a string does not run over a line end here
    return None


def _json_block(texts: list[str], idx: int, number: int) -> tuple[int, Found] | None:
    text = texts[idx]
    if not text.strip().startswith("{") or "kv_connector" not in "".join(texts[idx:idx + 5]):
        return None
    span = _balanced_span(texts, idx, text.index("{"), "{", "}", 400)
    if span is None:
        return None
    lines, body = span
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return lines, Found(number, "a JSON connector config", {}, (f"not JSON ({getattr(exc, 'msg', 'nested too deep')})",))
    if not isinstance(data, dict) or "kv_connector" not in data:
        return None
    return lines, Found(number, "a JSON connector config", {"kv_transfer_config": data})


_CALL = re.compile(r"\b(?P<name>LLM|EngineArgs|AsyncEngineArgs)\(")
CALL_KEYS = frozenset({"model", "tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size",
                       "enable_prefix_caching", "mamba_cache_mode", "block_size", "kv_offloading_size",
                       "kv_offloading_backend", "kv_transfer_config", "speculative_config", "scheduling_policy"})


def _call(texts: list[str], idx: int, number: int) -> tuple[int, Found] | None:
    m = _CALL.search(texts[idx])
    if m is None:
        return None
    span = _balanced_span(texts, idx, m.start("name") + len(m["name"]), "(", ")", 80)
    if span is None:
        return None
    lines, body = span
    what = f"the {m['name']}(...) call"
    args: dict[str, Any] = {}
    problems: list[str] = []
    try:
        tree = ast.parse("f" + body, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        tree = None  # not Python, or nested past what the parser takes
    if isinstance(tree, ast.Expression) and isinstance(tree.body, ast.Call):
        for kw in tree.body.keywords:
            if kw.arg in CALL_KEYS:
                try:
                    args[kw.arg] = ast.literal_eval(kw.value)
                except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                    problems.append(f"{kw.arg} is {ast.unparse(kw.value)[:40]} (not a literal: not read)")
        return lines, Found(number, what, _from_call(args), tuple(problems))
    # not Python (an unquoted model name): key=value lines, literal values only
    for piece in re.finditer(r"\b(?P<k>\w+)\s*=\s*(?P<v>[^,\n)]+)", body):
        key, value = piece["k"], piece["v"].strip()
        if key not in CALL_KEYS:
            continue
        try:
            args[key] = ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            if key == "model" and re.match(r"^[\w./-]+$", value):
                args[key] = value
            else:
                problems.append(f"{key} is {value[:40]} (not a literal: not read)")
    return lines, Found(number, what, _from_call(args), tuple(problems))


def _from_call(args: dict[str, Any]) -> dict[str, Any]:
    out = dict(args)
    for key in ("kv_transfer_config", "speculative_config"):
        if isinstance(out.get(key), str):
            try:
                out[key] = json.loads(out[key])
            except ValueError:
                out.pop(key)
    return out


# -- the config a V0-era or dump line prints ------------------------------------------------------
_CONFIG_PAIRS = re.compile(r"\b(?P<k>tensor_parallel_size|pipeline_parallel_size|data_parallel_size"
                           r"|enable_prefix_caching|model)=(?P<v>'[^']*'|[^,\s]+)")


def engine_line_config(text: str) -> dict[str, Any]:
    """``... LLM engine (vX) with config: model='...', tensor_parallel_size=2, ...`` -> the few
    values triage uses."""
    if "with config:" not in text:
        return {}
    out: dict[str, Any] = {}
    for m in _CONFIG_PAIRS.finditer(text.split("with config:", 1)[1]):
        value = m["v"].strip("'")
        # ASCII digits only (str.isdigit takes '²', which int() refuses), and not more than int() takes
        number = value.isascii() and value.isdigit() and len(value) <= 4000
        out[m["k"]] = int(value) if number else {"True": True, "False": False}.get(value, value)
    return out

