"""Read the deployed configuration out of a vLLM server log, or out of what a report pasted.

What vLLM prints at start-up, in its own words:

* ``vLLM API server version 0.26.0`` (the API server's banner); ``Initializing a V1 LLM engine
  (v0.26.0)`` or ``Dumping input data for V1 LLM engine (v0.26.0)`` stands in when the banner
  was cut off (any other version source: kvrepro/triage/sources.py);
* ``non-default args: {...}``: a Python dict repr of every argument that differs from the default,
  nested configs included (``'kv_transfer_config': KVTransferConfig(kv_connector='...', ...)``,
  ``'speculative_config': {'method': 'mtp', ...}``). It is parsed with :mod:`ast` and only literal
  nodes are turned into values (constants, dicts, lists, tuples, ``Name(...)`` calls with keyword
  arguments as dicts); nothing is evaluated;
* for a hybrid model, ``Mamba cache mode is set to 'align' ...`` / ``Prefix caching in Mamba cache
  'align' mode ...`` and ``Setting attention block size to N tokens ...``: what vLLM chose, which
  wins over what the args asked for.

A report rarely holds those; its command line, pod spec, connector JSON or ``LLM(...)`` call
(kvrepro/triage/sources.py) fill what vLLM's lines do not say, never overriding them (a
disagreement is reported). Every field keeps the line it came from; a complete argument list (the
args line, a whole command) also says what it leaves at vLLM's default, and says so; a field no
line says is "not in the log" (DeployedConfig.sources; DeployedConfig.lines has the line numbers
emit's bounds messages name).

A log is untrusted (issue 44): a version is kept to 40 characters (:func:`kvrepro.untrusted.quote`),
a number too long for ``int()`` by its size, and every value is quoted where it is shown.
Secret-looking values (``hf_token``, ``api_key``, a connector's ``...key``, ``ApiKey``, an
``X-Api-Key`` header, a URL's password) are replaced by ``***`` as they are read, and remembered
so that ``secrets.redact`` masks them anywhere else.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from ..classify.lines import LogLine
from ..secrets import is_secret_key, redact, remember, url_passwords
from ..untrusted import quote
from . import sources
from .records import DeployedConfig

_ARCH = re.compile(r"Resolved architecture: (?P<a>\w+)")
_MAMBA_MODE = re.compile(r"Mamba cache mode is set to '(?P<m>\w+)'|Prefix caching in Mamba cache '(?P<p>\w+)' mode")
_ATTN_BLOCK = re.compile(r"Setting attention block size to (?P<n>\d+) tokens")
_ENGINE_STREAM = re.compile(r"^EngineCore(?:_DP(?P<dp>\d+))?\b")
MAX_ARGS_CHARS = 1 << 20
MASK = "***"
# what a pasted report's own configuration sources are called where a default is inferred from them
_COMPLETE_SOURCES = ("vllm serve", "the API server command", "the docker command", "the pod's")


class ConfigReader:
    """Feed log lines (:meth:`feed`), and a pasted report's whole text (:meth:`feed_text`);
    :meth:`config` is what they said, each part with the line it came from."""

    def __init__(self, whole_text: bool = False) -> None:
        self.whole_text = whole_text  # feed_text will read multi-line sources: single lines skip them
        self.version: tuple[int, str, int, str] | None = None  # (rank, version, line, what said it)
        self.other_versions: dict[str, str] = {}  # another version a less trusted source gives -> where
        self.nightly: tuple[int, str] | None = None
        self.args: dict[str, Any] | None = None
        self.args_line: int | None = None
        self.args_problem: str | None = None
        self.architecture: tuple[int, str] | None = None
        self.mamba_mode_logged: tuple[int, str] | None = None
        self.attention_block: tuple[int, int] | None = None
        self.engines: set[str] = set()
        self.found: list[sources.Found] = []
        self.engine_line: tuple[int, dict[str, Any]] | None = None
        self._pip_show = False  # the line before was `pip show vllm`'s name line

    def feed(self, number: int, line: LogLine) -> None:
        if line.stream:
            m = _ENGINE_STREAM.match(line.stream)
            if m:
                self.engines.add(m["dp"] or "0")
        body = line.body
        if "non-default args" in body:
            if self.args is None:
                self._read_args(body)
                self.args_line = number
            return
        if self._pip_show and body.startswith("Version: "):
            # `pip show vllm`: "Name: vllm" then "Version: 0.26.0"
            if (hit := sources.find_version("vllm " + body[len("Version: "):].strip())) is not None:
                self._version(number, (hit[0], sources.PIP_SHOW_RANK, "pip show output"))
        self._pip_show = body.strip() == "Name: vllm"
        if (hit := sources.find_version(body)) is not None:
            self._version(number, hit)
            if "with config:" in body and self.engine_line is None:
                self.engine_line = (number, sources.engine_line_config(body))
        elif "vllm-openai:" in body and self.nightly is None and (tag := sources.nightly_image(body)):
            self.nightly = (number, tag)
        if "Resolved architecture" in body and self.architecture is None:
            if (m := _ARCH.search(body)) is not None:
                self.architecture = (number, m["a"])
        elif "Mamba cache" in body:
            if (m := _MAMBA_MODE.search(body)) is not None:
                self.mamba_mode_logged = (number, m["m"] or m["p"])
        elif "attention block size" in body and (m := _ATTN_BLOCK.search(body)) is not None:
            n = m["n"]
            # int() refuses more than 4,300 digits; a number that long is kept by its size alone
            self.attention_block = (number, int(n) if len(n) <= 4000 else 10 ** (len(n) - 1))
        elif not self.whole_text and line.header is None and ("--" in body or "vllm" in body):
            self.found.extend(sources.read_text([(number, body)]))

    def feed_text(self, numbered: list[tuple[int, str]]) -> None:
        """A pasted report's lines (normalised): command lines over several lines, argument lists,
        JSON connector configs, engine-argument calls, flags in prose."""
        self.found.extend(sources.read_text(numbered))

    def _version(self, number: int, hit: tuple[str, int, str]) -> None:
        version, rank, what = hit
        version = quote(version, 40)  # a 200 MB "version" is 40 characters here
        if self.version is None or rank < self.version[0]:
            if self.version is not None and self.version[1] != version:
                self.other_versions[self.version[1]] = f"line {self.version[2]}: {self.version[3]}"
            self.version = (rank, version, number, what)
        elif version != self.version[1]:
            self.other_versions.setdefault(version, f"line {number}: {what}")

    def _read_args(self, body: str) -> None:
        text = body.split("non-default args:", 1)[1].strip()[:MAX_ARGS_CHARS]
        try:
            value = parse_repr(text)
        except ValueError as exc:
            self.args, self.args_problem = {}, str(exc)
            return
        if not isinstance(value, dict):
            self.args, self.args_problem = {}, "the non-default args are not a dict"
            return
        self.args = mask_secrets(value)

    @property
    def vllm_lines_seen(self) -> bool:
        return bool(self.version or self.args is not None or self.engines or self.found or self.nightly)

    def _merged_args(self) -> tuple[dict[str, Any], dict[str, str], list[str]]:
        """Every argument the text gives (the non-default args line first, then each other source in
        order, then the engine's config line), where each came from, and the sources' disagreements."""
        args: dict[str, Any] = {}
        origin: dict[str, str] = {}
        problems: list[str] = []
        if self.args:
            args.update(self.args)
            origin.update((k, f"line {self.args_line}: the non-default args line") for k in self.args)
        for item in self.found:
            problems.extend(f"line {item.line}: {p}" for p in item.problems)
            for key, value in mask_secrets(item.args).items():
                if key not in args:
                    args[key], origin[key] = value, f"line {item.line}: {item.what}"
                elif args[key] != value and not isinstance(value, dict):
                    problems.append(f"line {item.line}: {item.what} gives {key} {value!r}; {origin[key]} gives "
                                    f"{args[key]!r} (kept)")
        if self.engine_line is not None:
            number, values = self.engine_line
            for key, value in values.items():
                if key not in args:
                    args[key], origin[key] = value, f"line {number}: the engine's config line"
        return args, origin, problems

    def _default_from(self) -> str | None:
        """The complete argument list, if any: it also says what it leaves at vLLM's default."""
        if self.args is not None and self.args_problem is None:
            return f"line {self.args_line}: the non-default args line"
        complete = [f for f in self.found if f.what.startswith(_COMPLETE_SOURCES) and not f.problems]
        return f"line {complete[0].line}: {complete[0].what}" if complete else None

    def _version_note(self, release: str | None) -> str | None:
        if self.other_versions:
            found = "; ".join(f"{v} at {where}" for v, where in self.other_versions.items())
            return f"other versions in the text: {found}"
        if release is None and self.nightly is not None:
            return (f"line {self.nightly[0]}: the image vllm/vllm-openai:{self.nightly[1]} is a build whose "
                    "release the tag does not say")
        return None

    def config(self) -> DeployedConfig:
        args, origin, problems = self._merged_args()
        default_from = self._default_from()
        src: dict[str, str] = {}
        mamba_default = False

        def note(name: str, *keys: str) -> None:
            for key in keys:
                if key in origin:
                    src[name] = origin[key]
                    return
            if default_from is not None:
                src[name] = f"{default_from} leaves it at vLLM's default"

        spec = _as_dict(args.get("speculative_config"))
        connector, settings, chunk = _connector_of(args)
        note("kv_connector", "kv_offloading_size", "kv_transfer_config")
        prefix = args.get("enable_prefix_caching")
        note("prefix_caching", "enable_prefix_caching")
        mode = self.mamba_mode_logged[1] if self.mamba_mode_logged else _str(args.get("mamba_cache_mode"))
        if self.mamba_mode_logged:
            src["mamba_cache_mode"] = f"line {self.mamba_mode_logged[0]}: vLLM's Mamba cache mode line"
        elif "mamba_cache_mode" in origin:
            src["mamba_cache_mode"] = origin["mamba_cache_mode"]
        elif default_from is not None:
            # vLLM chooses the default by the model: align for a hybrid one with prefix caching,
            # none for others; never all, which must be asked for
            src["mamba_cache_mode"] = f"{default_from} leaves it at vLLM's default (align or none by the model)"
            mamba_default = True
        if mode == "none" or prefix is False:
            mode = None  # no Mamba prefix caching: no Mamba cache mode that matters here
            if prefix is False and "prefix_caching" in src:
                src["mamba_cache_mode"] = src["prefix_caching"]
        block = self.attention_block[1] if self.attention_block else _int(args.get("block_size"))
        if self.attention_block:
            src["block_size"] = f"line {self.attention_block[0]}: vLLM's attention block size line"
        elif "block_size" in origin:
            src["block_size"] = origin["block_size"]
        method = _str(spec.get("method")) if spec else None
        note("speculative_method", "speculative_config")
        if spec and "num_speculative_tokens" in spec:
            src["num_speculative_tokens"] = origin.get("speculative_config", "")
        note("scheduling_policy", "scheduling_policy")
        note("tensor_parallel_size", "tensor_parallel_size")
        note("pipeline_parallel_size", "pipeline_parallel_size")
        note("data_parallel_size", "data_parallel_size")
        dp = _int(args.get("data_parallel_size"))
        if dp is None and len(self.engines) > 1:
            dp = len(self.engines)
            src["data_parallel_size"] = f"the log holds the lines of {dp} DP engines (at least DP{dp})"
        model = _str(args.get("model_tag") or args.get("model"))
        if model:
            src["model"] = origin.get("model_tag") or origin.get("model", "")
        release = None
        if self.version is not None:
            _, release, number, what = self.version
            src["release"] = f"line {number}: {what}"
        version_note = self._version_note(release)
        if self.architecture:
            src["architecture"] = f"line {self.architecture[0]}: vLLM's resolved-architecture line"
        return DeployedConfig(
            release=release,
            release_line=self.version[2] if self.version else None,
            args=args,
            args_problem=self.args_problem,
            model=model,
            architecture=self.architecture[1] if self.architecture else None,
            tensor_parallel_size=_int(args.get("tensor_parallel_size")) or 1,
            data_parallel_size=dp or max(1, len(self.engines)),
            pipeline_parallel_size=_int(args.get("pipeline_parallel_size")) or 1,
            engines_seen=len(self.engines),
            prefix_caching=prefix is not False,
            mamba_cache_mode=mode,
            block_size=block,
            kv_connector=connector,
            kv_connector_settings=settings,
            offload_chunk_tokens=_int(chunk),
            speculative_method=method,
            num_speculative_tokens=_int(spec.get("num_speculative_tokens")) if spec else None,
            scheduling_policy=_str(args.get("scheduling_policy")) or "fcfs",
            sources={k: v for k, v in src.items() if v},
            problems=tuple(problems),
            version_note=version_note,
            mamba_mode_default=mamba_default and mode is None,
            lines={**{name: _line_of(src.get(name)) for name in ("block_size", "mamba_cache_mode",
                                                               "num_speculative_tokens", "data_parallel_size",
                                                               "model")},
                   "offload_chunk_tokens": _line_of(origin.get("kv_transfer_config"))},
        )


def _connector_of(args: dict[str, Any]) -> tuple[str | None, dict[str, object], object]:
    """The KV connector the arguments configure, its settings, and its offload chunk (block_size in
    kv_connector_extra_config)."""
    transfer = _as_dict(args.get("kv_transfer_config"))
    settings: dict[str, object] = {}
    connector = None
    if args.get("kv_offloading_size") is not None:
        connector = "OffloadingConnector"
        settings = {k: args[k] for k in ("kv_offloading_size", "kv_offloading_backend") if k in args}
    if transfer:
        connector = str(transfer.get("kv_connector") or connector or "") or None
        settings.update({k: v for k, v in transfer.items() if k in ("kv_connector", "kv_role",
                                                                    "kv_connector_extra_config")})
    extra = _as_dict(transfer.get("kv_connector_extra_config")) if transfer else {}
    return connector, settings, extra.get("block_size")


_LINE_OF = re.compile(r"line (\d+):")


def _line_of(source: str | None) -> int | None:
    """The line number a ``sources`` entry names (``line 12: vllm serve``), or None."""
    m = _LINE_OF.match(source or "")
    return int(m[1]) if m else None


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


# -- the printed dict -----------------------------------------------------------------------------

_ANGLE = re.compile(r"<[^<>]*>")


def parse_repr(text: str) -> Any:
    """A value from its Python repr, without evaluating anything: literals, containers and
    ``Name(key=value, ...)`` calls (as ``{"__class__": "Name", ...}``); attribute paths
    (``CompilationMode.NONE``) and other names become their text. ValueError when it is not one."""
    try:
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError:
            # reprs such as <CUDAGraphMode.FULL: 2> or <object at 0x...> are not Python: keep their text
            try:
                tree = ast.parse(_ANGLE.sub(lambda m: repr(m.group(0)), text), mode="eval")
            except SyntaxError as exc:
                raise ValueError(f"not a Python dict repr (column {exc.offset}: {exc.msg}); the line may be cut "
                                 "off") from None
        return _value(tree.body)
    except (RecursionError, MemoryError):
        raise ValueError("nested deeper than a dict vLLM prints") from None


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Dict):
        return {_key(k): _value(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        value = node.operand.value
        if isinstance(value, (int, float)):
            return -value
    if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
        out: dict[str, Any] = {"__class__": ast.unparse(node.func)}
        for i, arg in enumerate(node.args):
            out[f"_{i}"] = _value(arg)
        for kw in node.keywords:
            out[kw.arg or "**"] = _value(kw.value)
        return out
    if isinstance(node, (ast.Name, ast.Attribute)):
        return ast.unparse(node)
    return ast.unparse(node)


def _key(node: ast.AST | None) -> str:
    value = _value(node) if node is not None else "**"
    return value if isinstance(value, str) else repr(value)


def mask_secrets(value: Any, key: str = "") -> Any:
    """``value`` with every value under a secret-looking key (hf_token, api_key, ...) masked; the
    masked values are remembered so that secrets.redact masks them wherever else they appear."""
    if isinstance(value, dict):
        return {k: mask_secrets(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_secrets(v, key) for v in value]
    if key and value not in (None, "", False) and is_secret_key(key):  # ApiKey, X-Api-Key, hf_token, ...
        remember([str(value)])
        return MASK
    if isinstance(value, str) and (passwords := url_passwords(value)):  # redis://user:PW@host
        remember(passwords)
        return redact(value)
    return value

