"""Write a minimized trace as a standalone pytest that drives vLLM's scheduler with it.

The emitted file is meant to be attached to an upstream pull request, in the style of vLLM's
``tests/v1/kv_connector/unit/offloading_connector/`` tests: it imports only vLLM, torch and
pytest (no kvrepro), builds vLLM's ``Scheduler`` from a hand-made ``VllmConfig`` and
``KVCacheConfig``, and steps it with fake model-runner outputs. What runs for real is all of
vLLM above the model runner: the scheduler, the KV-cache manager with its hybrid groups, the
spec-decode bookkeeping, the ``OffloadingConnector``'s scheduler side (with its CPU offloading
manager; it holds the assertion) and its worker side. Faked, exactly as kvrepro's GPU-free
executor fakes them, so the scheduling is step for step the engine's:

* the model: token values are a function of request and position; each scheduled MTP draft is
  accepted with the matrix's rate from a ``random.Random(seed)`` (the engine's seed for that
  repetition); a prefill chunk samples nothing; drafts are proposed after each sampled step;
* the offload data movement: an ``OffloadingWorker`` that moves no bytes and reports each job
  finished at the next step (the sim executor's ``SimTransferWorker``).

The test steps the scheduler in the engine mode the finding's run used (``async_scheduling`` as
vLLM resolved it for that run, :func:`kvrepro.engine.offline.describe`): synchronous, as
``EngineCore.step`` does; or asynchronous, as a GPU node runs this engine by default: the
scheduler class the release picks (``AsyncScheduler``), a batch queue of the release's
``max_concurrent_batches`` driven in ``EngineCore.step_with_batch_queue``'s order (a step is
scheduled and executed before the previous step's output is processed), and the fake runner one
step behind the scheduler as kvrepro's ``SimRunner`` (and vLLM's V1 GPU runner) is: the ``-1``
draft placeholders replaced by its own drafts, ``num_computed_tokens`` lowered by the previous
step's rejected drafts. Driving an asynchronous finding synchronously ran another sequence of
scheduler states: the minimizer's 4-request cut of 0.26.0's crash reached no offload hit at all.

The geometry is not re-derived: the minimizer's offline engine reports the settings vLLM
resolved from the matrix's ``vllm serve`` arguments and the KV-cache groups it built
(:func:`kvrepro.engine.offline.describe`), and they are written into the test as literals.

The test has no assertion about the bug: on a build with it, vLLM's own assertion fails inside
``Scheduler.schedule()``. It does assert that the sequence reached the bug's state (an offload
hit behind a local prefix hit), so a fixed build passes only by going through that state.

For a **corruption** (``violation=``: the engine served, but a forward read wrong KV), the test
also carries kvrepro's shadow KV: the source of :mod:`kvrepro.engine.shadow` (stdlib only) is
inlined verbatim at emit time, so the test and the engine check with the same code. It is
hooked where the GPU-free executor hooks it: the runner's request table and each request's
forward (``FakeModel``), the sampled tokens, and the offload stores and loads
(``InstantOffloadingWorker``). The test fails with an assertion that names, for the first
violation of each kind, the request, KV group, block index, GPU block, positions and what the
block holds instead; it passes when every checked context was right (and an offload hit
happened).

The test is generated as data: the skeleton (kvrepro/data/emitted-tests/offload_repro.py, a Python
module that linters and tests read like any other) is parsed; its docstring, constants and the
prompts are set in the tree from the finding (values as literal nodes, the KV-cache specs as the
checked trees of what the offline engine described), its emit-time settings bound and folded, the
shadow KV's tree added for a corruption, and the tree is unparsed (``ast.unparse``); what is written
is parsed and compiled again, and its constants compared with the finding's, before it is kept.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import paths
from ..errors import KvreproError
from ..loadgen.trace import Trace
from ..spec.matrix import LoadedMatrix

SKELETON = paths.PACKAGE_ROOT / "data" / "emitted-tests" / "offload_repro.py"

_PROMPTS = "P"  # the prompts list: its P.append statements follow it
_SHADOW_NAMES = {"shadow", "ShadowKV", "atexit"}  # what only a corruption test may name
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


class EmitError(KvreproError):
    """The emitted test could not be built from what the offline engine reported, or what was
    built does not parse back to it (a defect of kvrepro, or an engine description it does not
    know: the message names which)."""


def literal(value: Any) -> ast.expr:
    """A plain value (None, bool, int, float, str, list, tuple, dict of those) as an expression
    tree; anything else is refused, so nothing but data reaches the written test this way."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return ast.Constant(value)
    if isinstance(value, list):
        return ast.List([literal(v) for v in value], ast.Load())
    if isinstance(value, tuple):
        return ast.Tuple([literal(v) for v in value], ast.Load())
    if isinstance(value, dict):
        return ast.Dict([literal(k) for k in value], [literal(v) for v in value.values()])
    raise EmitError(f"a value of type {type(value).__name__} cannot be written into the test: {value!r:.80}")


def spec_expression(source: str, names: set[str]) -> ast.expr:
    """A KV-cache spec as the offline engine described it (``FullAttentionSpec(block_size=16, ...)``),
    parsed and checked to be a call of one of the release's spec classes with keyword arguments
    that are literals or names the spec imports bring (``torch.bfloat16``); the tree, not the
    text, goes into the test."""
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError as exc:
        raise EmitError(f"KV-cache spec {source[:80]!r}: not an expression ({exc.msg})") from None

    def check(node: ast.AST) -> None:
        if isinstance(node, ast.Constant):
            return
        if isinstance(node, (ast.Tuple, ast.List)):
            for element in node.elts:
                check(element)
            return
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return check(node.operand)
        if isinstance(node, ast.Attribute):
            return check(node.value)
        if isinstance(node, ast.Name) and node.id in names:
            return
        raise EmitError(f"KV-cache spec {source[:80]!r}: {ast.unparse(node)[:60]!r} is not a literal or a "
                        f"name of the spec imports ({', '.join(sorted(names))})")

    if not (isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and tree.func.id in names
            and not tree.args and all(k.arg for k in tree.keywords)):
        raise EmitError(f"KV-cache spec {source[:80]!r}: not a call of a spec class with keyword arguments")
    for keyword in tree.keywords:
        check(keyword.value)
    return tree


def _imports(skeleton: list[ast.stmt], spec_names: list[str], more: list[ast.stmt]) -> list[ast.stmt]:
    """The test's imports: the skeleton's, the release's KV-cache spec imports and (``more``) the
    inlined shadow KV's, merged by module; the standard library first, then vLLM and torch, each
    group's ``import x`` before its ``from m import ...`` (isort's order)."""
    plain: set[str] = set()
    froms: dict[str, set[str]] = {}
    for node in [*skeleton, *more]:
        if isinstance(node, ast.Import):
            plain |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            froms.setdefault(node.module or "", set()).update(a.name for a in node.names)
    for name in spec_names:
        if not _DOTTED.fullmatch(name):
            raise EmitError(f"spec import {name!r}: not a dotted name")
        module, _, attr = name.rpartition(".")
        if module:
            froms.setdefault(module, set()).add(attr)
        else:
            plain.add(attr)

    def stdlib(module: str) -> bool:
        return module.split(".")[0] in sys.stdlib_module_names

    out: list[ast.stmt] = []
    for group in (True, False):
        out += [ast.Import([ast.alias(n)]) for n in sorted(plain) if stdlib(n) == group]
        out += [ast.ImportFrom(m, [ast.alias(n) for n in sorted(froms[m], key=lambda n: (not n[0].isupper(), n))], 0)
                for m in sorted(froms) if stdlib(m) == group]
    return out


class _Fill(ast.NodeTransformer):
    """Binds the skeleton's emit-time settings (``_NAME``) to their values and folds what they
    decide: ``if CONST:`` keeps a branch, ``a if CONST else b`` one side, ``"a" + "b"`` joins,
    ``f(**{"k": v})`` becomes ``f(k=v)``."""

    def __init__(self, values: dict[str, ast.expr]):
        self.values = values
        self.used: set[str] = set()

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if isinstance(node.ctx, ast.Load) and node.id in self.values:
            self.used.add(node.id)
            return copy.deepcopy(self.values[node.id])
        return node

    def visit_If(self, node: ast.If):
        self.generic_visit(node)
        if isinstance(node.test, ast.Constant):
            return node.body if node.test.value else node.orelse
        return node

    def visit_IfExp(self, node: ast.IfExp) -> ast.expr:
        self.generic_visit(node)
        if isinstance(node.test, ast.Constant):
            return node.body if node.test.value else node.orelse
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.expr:
        self.generic_visit(node)
        if isinstance(node.op, ast.Add) and all(isinstance(x, ast.Constant) and isinstance(x.value, str)
                                               for x in (node.left, node.right)):
            return ast.Constant(node.left.value + node.right.value)
        return node

    def visit_Call(self, node: ast.Call) -> ast.expr:
        self.generic_visit(node)
        keywords: list[ast.keyword] = []
        for keyword in node.keywords:
            value = keyword.value
            if keyword.arg is None and isinstance(value, ast.Dict) and all(
                    isinstance(k, ast.Constant) and isinstance(k.value, str) for k in value.keys):
                keywords += [ast.keyword(k.value, v) for k, v in zip(value.keys, value.values)]
            else:
                keywords.append(keyword)
        node.keywords = keywords
        return node


def _target(node: ast.stmt) -> str | None:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def build_module(doc: str, settings: dict[str, Any], constants: dict[str, ast.expr], prompts: list[ast.stmt],
                 spec_imports: list[str], carried: list[tuple[list[ast.stmt], list[ast.stmt]]],
                 future: bool) -> ast.Module:
    """The test's syntax tree: the skeleton's (kvrepro/data/emitted-tests/) with ``doc`` as its
    docstring, ``settings`` bound and folded, ``constants`` as the values of its module-level
    constants, the prompts after ``P``, and the kvrepro modules it carries (:func:`inlined`: their
    imports join the test's, their code follows the imports); ``future``: postponed annotations."""
    tree = ast.parse(SKELETON.read_text(encoding="utf-8"))
    body = tree.body[1:] if ast.get_docstring(tree, clean=False) is not None else tree.body
    imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assigned = {_target(n) for n in body if (_target(n) or "").startswith("_")}
    if assigned != set(settings):
        raise EmitError(f"{SKELETON}: its settings {sorted(assigned)} are not the emitter's {sorted(settings)}")
    rest: list[ast.stmt] = []
    seen = set()
    for node in body:
        name = _target(node)
        if node in imports or name in settings:
            continue
        if name in constants:
            seen.add(name)
            node = ast.Assign([ast.Name(name, ast.Store())], constants[name])
        rest.append(node)
        if name == _PROMPTS:
            seen.add(name)
            rest += prompts
    if seen != {*constants, _PROMPTS}:
        raise EmitError(f"{SKELETON}: no module-level {', '.join(sorted({*constants, _PROMPTS} - seen))}")
    fill = _Fill({k: literal(v) for k, v in settings.items()})
    rest = [fill.visit(n) for n in rest]
    rest = [x for n in rest for x in (n if isinstance(n, list) else [n])]
    head: list[ast.stmt] = [ast.Expr(ast.Constant(doc))]
    if future:
        head.append(ast.ImportFrom("__future__", [ast.alias("annotations")], 0))
    head += _imports(imports, spec_imports, [n for more, _ in carried for n in more])
    module = ast.Module([*head, *(n for _, code in carried for n in code), *rest], [])
    return ast.fix_missing_locations(module)


def checked_source(module: ast.Module, name: str, constants: dict[str, ast.expr], settings: dict[str, Any],
                   shadow: bool) -> str:
    """``module`` unparsed, then parsed and compiled back: every constant reads as its value, no
    emit-time setting is left, and a crash test names nothing of the shadow KV."""
    text = ast.unparse(module) + "\n"
    try:
        back = ast.parse(text)
        compile(back, name, "exec")
    except SyntaxError as exc:
        raise EmitError(f"{name}: the written test does not parse: {exc}") from None
    written = {_target(n): n.value for n in back.body if _target(n) in constants}
    for key, tree in constants.items():
        if key not in written or ast.dump(written[key]) != ast.dump(tree):
            raise EmitError(f"{name}: {key} does not read back as the finding's value")
    names = {n.id for n in ast.walk(back) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(back) if isinstance(n, ast.Attribute)}
    left = (set(settings) | (set() if shadow else _SHADOW_NAMES)) & names
    if left:
        raise EmitError(f"{name}: the written test still names {', '.join(sorted(left))}")
    return text


def inlined(module) -> tuple[list[ast.stmt], list[ast.stmt], str]:
    """A kvrepro module the test carries (it imports nothing of kvrepro), so the test runs the code
    kvrepro's GPU-free engine runs: its imports (stdlib, for the test's import block), the rest of
    its tree, and the file with its sha256 (for the test's docstring). Its docstring is left out
    (the test's own says what the code is for)."""
    path = Path(module.__file__)
    text = path.read_text(encoding="utf-8")
    imports, code = [], []
    for node in ast.parse(text).body:
        if not code and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if not code and isinstance(node, (ast.Import, ast.ImportFrom)):
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                imports.append(node)
            continue
        code.append(node)
    origin = (f"kvrepro/{path.relative_to(paths.PACKAGE_ROOT).as_posix()} "
              f"(sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]})")
    return imports, code, origin


def _prompt_statements(prompts: list[list[int]]) -> list[ast.stmt]:
    """``P.append(P[j][:n] + [...])`` per prompt: the longest prefix shared with an earlier prompt
    (at least 16 tokens) is written as a slice of it (shared prefixes are what the bug is about),
    the rest as literal token ids."""
    out: list[ast.stmt] = []
    for i, tokens in enumerate(prompts):
        best_n, best_j = 0, None
        for j in range(i):
            other, n = prompts[j], 0
            limit = min(len(tokens), len(other))
            while n < limit and tokens[n] == other[n]:
                n += 1
            if n > best_n:
                best_n, best_j = n, j
        if best_j is not None and best_n >= 16:
            head: ast.expr = ast.Subscript(
                ast.Subscript(ast.Name(_PROMPTS, ast.Load()), ast.Constant(best_j), ast.Load()),
                ast.Slice(None, ast.Constant(best_n)), ast.Load())
            rest = tokens[best_n:]
            value = ast.BinOp(head, ast.Add(), literal(list(rest))) if rest else head
        else:
            value = literal(list(tokens))
        call = ast.Call(ast.Attribute(ast.Name(_PROMPTS, ast.Load()), "append", ast.Load()), [value], [])
        out.append(ast.Expr(call))
    return out


@dataclass(frozen=True)
class SpeculativeInfo:
    method: str | None
    num_speculative_tokens: int


@dataclass(frozen=True)
class KvTransferInfo:
    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class KvGroupInfo:
    layer_names: tuple[str, ...]
    spec: str  # the KV-cache spec as Python source


@dataclass(frozen=True)
class KvTensorInfo:
    size: int
    shared_by: tuple[str, ...]  # the layers of the allocation
    # 0.30+: the release's placement fields (layer_stride, block_stride, offset, ...); None: shared_by's form
    placement: dict[str, Any] | None = None


@dataclass(frozen=True)
class EngineInfo:
    """What the offline engine built for a build (:func:`kvrepro.engine.offline.describe`: its
    settings and KV-cache groups), parsed once from its ``ready`` line (:meth:`from_json`)."""

    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int
    async_scheduling: bool
    disable_hybrid_kv_cache_manager: bool
    scheduler_block_size: int
    hash_block_size: int
    kv_cache_groups: tuple[KvGroupInfo, ...]
    kv_cache_tensors: tuple[KvTensorInfo, ...]
    spec_imports: tuple[str, ...]
    vllm: str | None = None
    dtype: str = "auto"
    vocab_size: int | None = None
    mamba_cache_mode: str | None = None
    speculative: SpeculativeInfo | None = None
    kv_transfer: KvTransferInfo | None = None

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "EngineInfo":
        """Strict on the fields it has (RecordError names a wrong one), lenient on keys another
        version of the offline engine adds."""
        from ..records import from_jsonable

        names = {f.name for f in dataclasses.fields(cls)}
        return from_jsonable(cls, {k: v for k, v in value.items() if k in names}, "engine")


def render(trace: Trace, loaded: LoadedMatrix, engine: EngineInfo, name: str,
           runs: dict[str, tuple[str, str, str]], violation: str | None = None,
           first_violation: str | None = None) -> str:
    """The test file's text. ``engine``: :func:`kvrepro.engine.offline.describe` of the build;
    ``runs``: build -> (python, PYTHONPATH, what it shows) for the header. ``violation`` (a kind
    of shadow-KV violation, ``full_attention+offload``): the corruption test instead, with the
    shadow KV inlined; ``first_violation``: what the offline engine saw, for its docstring."""
    matrix = loaded.matrix
    sig = matrix.target_signature
    model_config = json.loads((Path(loaded.model_dir()) / "config.json").read_text())
    model_config = {k: v for k, v in model_config.items() if not k.startswith("_")}
    rep = trace.header.rep or 0
    spec = engine.speculative
    transfer = engine.kv_transfer or KvTransferInfo()
    prompts = [list(r.tokens) for r in trace.requests]
    spec_names = {n.rpartition(".")[2] for n in engine.spec_imports}
    settings = {
        "_SHADOW_KV": bool(violation),
        "_OFFLOAD_HIT_TARGET": sig.function == "update_state_after_alloc",
        "_REQUIRE_OFFLOAD_HIT": bool(violation) and violation.endswith("+offload"),
        "_DTYPE": engine.dtype, "_ENABLE_PREFIX_CACHING": engine.enable_prefix_caching,
        "_HASH_ALGO": engine.prefix_caching_hash_algo,
        "_MAMBA_CACHE_KW": {"mamba_cache_mode": engine.mamba_cache_mode} if engine.mamba_cache_mode else {},
        "_MAX_NUM_SEQS": engine.max_num_seqs, "_MAX_NUM_BATCHED_TOKENS": engine.max_num_batched_tokens,
        "_ENABLE_CHUNKED_PREFILL": engine.enable_chunked_prefill,
        "_LONG_PREFILL_TOKEN_THRESHOLD": engine.long_prefill_token_threshold,
        "_SPECULATIVE": spec is not None, "_SPEC_METHOD": spec.method if spec else None,
        "_NUM_SPECULATIVE_TOKENS": spec.num_speculative_tokens if spec else 0,
        "_KV_CONNECTOR": transfer.kv_connector, "_KV_ROLE": transfer.kv_role,
        "_KV_EXTRA": dict(transfer.kv_connector_extra_config),
        "_DISABLE_HYBRID": engine.disable_hybrid_kv_cache_manager,
        "_SCHEDULER_BLOCK_SIZE": engine.scheduler_block_size, "_HASH_BLOCK_SIZE": engine.hash_block_size,
    }
    requests: list[ast.expr] = []
    for i, r in enumerate(trace.requests):
        item = [literal(r.max_tokens), ast.Subscript(ast.Name(_PROMPTS, ast.Load()), ast.Constant(i), ast.Load())]
        if r.events is not None and r.events.abort == "queued":
            item.append(ast.Constant("abort-queued"))
        requests.append(ast.Tuple(item, ast.Load()))
    constants: dict[str, ast.expr] = {
        "MODEL_CONFIG": literal(model_config), "MAX_MODEL_LEN": literal(engine.max_model_len),
        "BLOCK_SIZE": literal(engine.block_size), "NUM_GPU_BLOCKS": literal(engine.num_gpu_blocks),
        "SEED": literal(matrix.engine.sim.seed + rep),
        "DRAFT_ACCEPTANCE_RATE": literal(matrix.engine.sim.draft_acceptance_rate),
        "ASYNC_SCHEDULING": literal(engine.async_scheduling),
        "KV_CACHE_GROUPS": ast.List([ast.Tuple([literal(list(g.layer_names)), spec_expression(g.spec, spec_names)],
                                               ast.Load()) for g in engine.kv_cache_groups], ast.Load()),
        "KV_CACHE_TENSORS": literal([(t.size, list(t.shared_by), t.placement) for t in engine.kv_cache_tensors]),
        "REQUESTS": ast.List(requests, ast.Load()),
    }
    from ..engine import device_pointers, shadow as shadow_kv

    carried = [inlined(device_pointers)] + ([inlined(shadow_kv)] if violation else [])
    doc = (_docstring(trace, loaded, engine, name, runs, violation, first_violation)
           + "\nInlined from kvrepro at emit time, unchanged (the code its GPU-free engine runs): "
           + ", ".join(origin for _, _, origin in carried) + ".\n")
    module = build_module(doc, settings, constants, _prompt_statements(prompts), list(engine.spec_imports),
                          [(more, code) for more, code, _ in carried], future=bool(violation))
    return checked_source(module, name, constants, settings, shadow=bool(violation))


_OFFLOAD_HIT_SITUATION = "A KV-offloading request whose offload hit sits behind a partial local (GPU prefix-cache) hit"
_SITUATIONS = {  # the crash test's first line of its story, by what the sequence does
    "offload-hit": _OFFLOAD_HIT_SITUATION,
    "queued-abort": ("KV offloading on, a request the client gives up on while it is still queued (never "
                     "scheduled; \"abort-queued\" below)"),
    "other": "A sequence of KV-offloading requests",
}


def _docstring(trace: Trace, loaded: LoadedMatrix, engine: EngineInfo, name: str,
               runs: dict[str, tuple[str, str, str]], violation: str | None, first_violation: str | None) -> str:
    """The test's docstring (prose): what it reproduces, how the sequence was found, what is real
    and what is faked, and how to run it with each build."""
    matrix = loaded.matrix
    sig = matrix.target_signature
    spec = engine.speculative
    num_spec = spec.num_speculative_tokens if spec else 0
    tokens = sum(len(r.tokens) for r in trace.requests)
    model = (f"on a hybrid model (Gated-DeltaNet Mamba groups + a full-attention group, Mamba cache mode\n"
             f"{engine.mamba_cache_mode!r}, MTP with {num_spec} speculative {'token' if num_spec == 1 else 'tokens'}). "
             f"The sequence below is {len(trace.requests)} requests\n"
             f"({tokens} prompt tokens), sent one at a time, each run to completion before the next; kvrepro\n")
    source = trace.header.minimized_from or trace.path
    drives = ("It drives vLLM's Scheduler, KV-cache manager and OffloadingConnector (scheduler side with the\n"
              "real CPU offloading manager, and worker side) directly. Faked: the model (sampled and draft\n"
              f"tokens are deterministic; drafts are accepted with probability "
              f"{matrix.engine.sim.draft_acceptance_rate!r} from a seeded RNG)\n"
              "and the offload data movement (a job is reported finished one step after it is submitted).")
    run_lines = "\n".join(f"    # {label}\n    VLLM_PLUGINS= PYTHONPATH={pythonpath} {python} {name}"
                          for python, pythonpath, label in runs.values())
    mode = _mode_doc(engine.async_scheduling, engine.vllm or matrix.base)
    if violation:
        offload = violation.endswith("+offload")
        situation = (_OFFLOAD_HIT_SITUATION if offload else
                     "A request with a local (GPU prefix-cache) hit and no offload hit, KV offloading on")
        seen = _wrap(first_violation or "(not recorded)", 96, "    ").strip()
        return (
            f"Regression test: vLLM {matrix.base} reads wrong KV ({violation}) under KV offloading.\n\n"
            f"{situation},\n{model}"
            "minimized it from a load run in which the engine served every request, but a forward read KV\n"
            f"that its request's context does not have ({source}).\n\n{mode}\n\n{drives}\n\n"
            "Nothing computes KV here, so the test keeps a *shadow KV* (kvrepro's, inlined below): for every\n"
            "GPU block and every offloaded block, which tokens' KV it would hold (a token's KV is named by a\n"
            "hash of the token prefix it was computed from), written by each forward where vLLM's GPU model\n"
            "runner writes it and copied by each offload store and load as the CPU offloading worker copies\n"
            "it. Before every forward it checks that each scheduled request's context below its computed\n"
            "count is there: every position of a full-attention group, and for a Mamba `align` group the\n"
            "state after exactly the computed prefix, in the block the runner reads it from. The test fails\n"
            "when a forward would read wrong KV, naming the request, group, block index, GPU block, positions\n"
            f"and what the block holds instead. Seen with vLLM {matrix.base} (kvrepro's offline engine, same code):"
            f"\n\n    {seen}\n\n"
            f"With a fix the sequence runs clean{'; the test also checks that it reached an offload hit' if offload else ''}."
            "\n\nNeeds only vLLM (no GPU) and torch; pytest is optional. Run it as a script, with a build's vLLM\n"
            "first on PYTHONPATH (exit 1 with the assertion when a forward reads wrong KV, 0 when clean):\n"
            f"{run_lines}\n{_RUN_TAIL}{name}`.\n")
    if sig.function == "update_state_after_alloc":
        story, reach = "offload-hit", ("fix the sequence runs through, and the test checks it did reach the "
                                       "offload-hit-behind-a-local-\nhit state.")
    else:
        queued = any(r.events is not None and r.events.abort == "queued" for r in trace.requests)
        story, reach = ("queued-abort" if queued else "other"), "fix the sequence runs through, and that is the pass."
    expression = f"The assertion: `{sig.expression}`.\n\n" if sig.expression else ""
    return (
        f"Regression test: vLLM {matrix.base}, {sig.exception} in {_qualified(sig.function, sig.file)}.\n\n"
        f"{expression}{_SITUATIONS[story]},\n{model}"
        f"minimized it from a load run that crashed the engine ({source}).\n\n{mode}\n\n{drives} The\n"
        "test has no assertion about the bug: with it, vLLM's assertion fails inside schedule(); with a\n"
        f"{reach}\n\n"
        "Needs only vLLM (no GPU) and torch; pytest is optional. Run it as a script, with a build's vLLM\n"
        "first on PYTHONPATH (exit 1 with vLLM's traceback when the bug fires, 0 when it runs through):\n"
        f"{run_lines}\n{_RUN_TAIL}{name}`.\n")


_RUN_TAIL = ("(VLLM_PLUGINS= keeps vLLM from loading the platform plugin kvrepro's overlays carry), or under\n"
             "pytest, in an environment that has vLLM and pytest: `python -m pytest -q ")


def _mode_doc(async_scheduling: bool, vllm: str) -> str:
    """The test docstring's paragraph on the engine mode it steps the scheduler in (the run's)."""
    if async_scheduling:
        text = (f"Engine mode: asynchronous scheduling, as the run had it (vLLM's default on a GPU for this "
                f"engine). The scheduler is the class vLLM {vllm} picks for it (AsyncScheduler), stepped in "
                "EngineCore.step_with_batch_queue's order: each step is scheduled and executed before the "
                "previous step's output is processed (a batch queue of max_concurrent_batches); the fake "
                "runner fills the -1 draft placeholders with its own drafts and lowers the computed count "
                "by the drafts the previous step rejected, as vLLM's GPU model runner does.")
    else:
        text = ("Engine mode: synchronous scheduling, as the run had it (async_scheduling off). The "
                "scheduler is stepped as EngineCore.step does: schedule, execute, process the output, "
                "then hand the drafts to the scheduler.")
    return _wrap(text, 96, "").strip()


def _wrap(literal: str, width: int, indent: str) -> str:
    out, line = [], indent
    for part in literal.split(" "):
        if len(line) + len(part) + 1 > width and line.strip():
            out.append(line.rstrip())
            line = indent
        line += part + " "
    if line.strip():
        out.append(line.rstrip())
    return "\n".join(out)


def _qualified(function: str, file: str | None) -> str:
    """``OffloadingConnectorScheduler.update_state_after_alloc`` for the shipped signature."""
    known = {"update_state_after_alloc": "OffloadingConnectorScheduler"}
    if file and file.endswith("offloading/scheduler.py") and function in known:
        return f"{known[function]}.{function}"
    return function


def corruption_marker(violation: str) -> str:
    """How the emitted corruption test's assertion message tags the first violation of a kind."""
    return f"[{violation}] "


def emit(path: Path, trace: Trace, loaded: LoadedMatrix, engine: EngineInfo,
         runs: dict[str, tuple[str, str, str]], violation: str | None = None,
         first_violation: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(trace, loaded, engine, path.name, runs, violation, first_violation))


@dataclass(frozen=True)
class EmittedRun:
    """One run of an emitted test with a build's vLLM: its exit status, the failing frame read from
    the traceback's last frame (``exception`` to ``statement``), ``tail`` (the output's last lines),
    ``message`` (the last exception's message, all its lines) and ``output`` (stderr's end)."""

    exit: int
    exception: str | None
    file: str | None
    function: str | None
    statement: str | None
    tail: str
    message: str
    output: str


def run_emitted(path: Path, python: str, pythonpath: str, timeout: float = 600) -> EmittedRun:
    """Run the emitted file as a script with a build's vLLM (see :class:`EmittedRun`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVREPRO_", "VLLM_"))}
    env.update(PYTHONPATH=pythonpath, VLLM_PLUGINS="", VLLM_LOGGING_LEVEL="ERROR")
    from .. import lifetime, paths, scratch

    paths.keep_byte_code(env)  # the build's byte code where its engines keep theirs (compiled once)

    env.update(scratch.engine_env())  # its temporary files go where kvrepro's go (removed on exit)
    path = path.resolve()  # it runs in its own folder: a path relative to ours would name the wrong file
    proc = subprocess.run([python, str(path)], env=env, cwd=str(path.parent), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          preexec_fn=lifetime.child_hook(signal.SIGKILL))  # never outlives kvrepro
    text = proc.stderr
    frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)\n\s+(.*)', text)
    last = re.findall(r"^(\w+(?:Error|Exception)|AssertionError)\b.*$", text, flags=re.M)
    return EmittedRun(exit=proc.returncode, exception=last[-1] if last else None,
                      file=frames[-1][0] if frames else None,
                      function=frames[-1][1] if frames else None,
                      statement=frames[-1][2].strip() if frames else None,
                      tail="\n".join((proc.stdout + text).strip().splitlines()[-6:]),
                      message=_last_exception_message(text), output=text[-20000:])


def _last_exception_message(text: str) -> str:
    """The message of the traceback's final exception, with its continuation lines."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(r"^(\w+(?:Error|Exception))(?::\s?(.*))?$", lines[i])
        if m:
            return "\n".join([m[2] or ""] + [x for x in lines[i + 1:] if x.strip()]).strip()
    return ""
