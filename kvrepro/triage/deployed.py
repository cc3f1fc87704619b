"""Read the deployed configuration out of a vLLM server log.

What vLLM prints at start-up, in its own words:

* ``vLLM API server version 0.26.0`` (the API server's banner); ``Initializing a V1 LLM engine
  (v0.26.0)`` stands in when the banner was cut off;
* ``non-default args: {...}``: a Python dict repr of every argument that differs from the default,
  nested configs included (``'kv_transfer_config': KVTransferConfig(kv_connector='...', ...)``,
  ``'speculative_config': {'method': 'mtp', ...}``). It is parsed with :mod:`ast` and only literal
  nodes are turned into values (constants, dicts, lists, tuples, ``Name(...)`` calls with keyword
  arguments as dicts); nothing is evaluated;
* for a hybrid model, ``Mamba cache mode is set to 'align' ...`` / ``Prefix caching in Mamba cache
  'align' mode ...`` and ``Setting attention block size to N tokens ...``: what vLLM chose, which
  wins over what the args asked for.

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
from .records import DeployedConfig

_VERSION = re.compile(r"vLLM API server version (?P<v>\S+)")
_ENGINE_VERSION = re.compile(r"Initializing a V1 LLM engine \(v(?P<v>[^)\s]+)\)")
_ARCH = re.compile(r"Resolved architecture: (?P<a>\w+)")
_MAMBA_MODE = re.compile(r"Mamba cache mode is set to '(?P<m>\w+)'|Prefix caching in Mamba cache '(?P<p>\w+)' mode")
_ATTN_BLOCK = re.compile(r"Setting attention block size to (?P<n>\d+) tokens")
_ENGINE_STREAM = re.compile(r"^EngineCore(?:_DP(?P<dp>\d+))?\b")
MAX_ARGS_CHARS = 1 << 20
MASK = "***"


class ConfigReader:
    """Feed log lines; :meth:`config` is what they said."""

    def __init__(self) -> None:
        self.release: str | None = None
        self.release_line: int | None = None
        self.engine_release: str | None = None
        self.args: dict[str, Any] | None = None
        self.args_problem: str | None = None
        self.architecture: str | None = None
        self.mamba_mode_logged: str | None = None
        self.attention_block: int | None = None
        self.engines: set[str] = set()
        self.lines: dict[str, int] = {}  # where each value came from: "args", "attention_block", "mamba_mode"

    def feed(self, number: int, line: LogLine) -> None:
        if line.stream:
            m = _ENGINE_STREAM.match(line.stream)
            if m:
                self.engines.add(m["dp"] or "0")
        body = line.body
        if "vLLM API server version" in body and self.release is None:
            if (m := _VERSION.search(body)) is not None:  # quoted: a 200 MB "version" is 80 characters here
                self.release, self.release_line = quote(m["v"].lstrip("v"), 40), number
        elif "non-default args" in body and self.args is None:
            self.lines["args"] = number
            self._read_args(body)
        elif "Initializing a V1 LLM engine" in body and self.engine_release is None:
            if (m := _ENGINE_VERSION.search(body)) is not None:
                self.engine_release = quote(m["v"], 40)
        elif "Resolved architecture" in body and self.architecture is None:
            if (m := _ARCH.search(body)) is not None:
                self.architecture = m["a"]
        elif "Mamba cache" in body:
            if (m := _MAMBA_MODE.search(body)) is not None:
                self.mamba_mode_logged = m["m"] or m["p"]
                self.lines["mamba_mode"] = number
        elif "attention block size" in body and (m := _ATTN_BLOCK.search(body)) is not None:
            n = m["n"]
            # int() refuses more than 4,300 digits; a number that long is kept by its size alone
            self.attention_block = int(n) if len(n) <= 4000 else 10 ** (len(n) - 1)
            self.lines["attention_block"] = number

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
        return bool(self.release or self.engine_release or self.args is not None or self.engines)

    def config(self) -> DeployedConfig:
        args = self.args or {}
        spec = _as_dict(args.get("speculative_config"))
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
        chunk = extra.get("block_size")
        prefix = args.get("enable_prefix_caching")
        mode = self.mamba_mode_logged or _str(args.get("mamba_cache_mode"))
        if mode == "none" or prefix is False:
            mode = None  # no Mamba prefix caching: no Mamba cache mode that matters here
        block = self.attention_block or _int(args.get("block_size"))
        method = _str(spec.get("method")) if spec else None
        return DeployedConfig(
            release=self.release or self.engine_release,
            release_line=self.release_line,
            args=args,
            args_problem=self.args_problem,
            model=_str(args.get("model_tag") or args.get("model")),
            architecture=self.architecture,
            tensor_parallel_size=_int(args.get("tensor_parallel_size")) or 1,
            data_parallel_size=_int(args.get("data_parallel_size")) or max(1, len(self.engines)),
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
            lines={"block_size": self.lines.get("attention_block" if self.attention_block else "args"),
                   "mamba_cache_mode": self.lines.get("mamba_mode" if self.mamba_mode_logged else "args"),
                   **{k: self.lines["args"] for k in ("offload_chunk_tokens", "num_speculative_tokens",
                                                      "data_parallel_size", "model") if "args" in self.lines}},
        )


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
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        # reprs such as <CUDAGraphMode.FULL: 2> or <object at 0x...> are not Python: keep their text
        try:
            tree = ast.parse(_ANGLE.sub(lambda m: repr(m.group(0)), text), mode="eval")
        except SyntaxError as exc:
            raise ValueError(f"not a Python dict repr (column {exc.offset}: {exc.msg}); the line may be cut off") \
                from None
    return _value(tree.body)


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

