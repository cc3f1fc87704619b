"""The upstream report for a STALL that a failed offload load left behind: a regression test for vLLM.

``kvrepro minimize RUN --build B --emit-pytest FILE`` on a repetition whose verdict is STALL after an
injected load failure under ``kv_load_failure_policy: recompute`` (``recompute-failed-load-stall``)
writes a test in the style of vLLM's own scheduler tests
(``tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py``: vLLM's test helpers, its own mock
connector, no kvrepro import), with the run's numbers -- the block size, the pool, the stuck
request's prompt -- and the mechanism with the build's own line numbers, read from the build's
``vllm/v1/core/sched/scheduler.py`` with :mod:`ast`. It then runs the file with vLLM's pytest in the
release's sdist ``tests/`` (kvrepro/builds/standalone_test.py) on the build and on the build plus
``--fixed`` (a patch declared in the matrix, such as ``fix-recompute-failed-load-reservation``, or a
build): it must fail on the build with the reserved and free block counts in its message, and pass
with the fix.

No trace shrinking happens for a stall: its reproducer is one request whose blocks, counted twice,
exceed the free pool, and the scheduler-level test states exactly that; the run supplies the numbers.

The test is generated as data: the skeleton (kvrepro/data/upstream-tests/, a Python module that
linters and tests read like any other) is parsed, its module-level constants and docstring are
replaced in the tree, and the tree is unparsed; what is written is parsed again before it is kept.
"""

from __future__ import annotations

import ast
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..errors import KvreproError, SpecError

SKELETON = paths.PACKAGE_ROOT / "data" / "upstream-tests" / "recompute_failed_load_stall.py"
# where the test belongs in vLLM's tree: beside test_kv_load_failure_recovery.py, whose
# test_failed_receive_completion_honors_failure_policy is the same path with a synchronous retry
UPSTREAM_PATH = "tests/v1/kv_connector/unit/test_recompute_failed_load_stall.py"
SCHEDULER = "vllm/v1/core/sched/scheduler.py"
TEST_NAME = "test_failed_async_load_recompute_schedules_the_retry"
FAILING_CASE = "one-request-over-half-the-pool"
# what the assertion message says at the stall (the skeleton's stall_numbers)
STALL_WORDS = "blocks reserved for in-flight prefills"


@dataclass(frozen=True)
class StallCase:
    """What the emitted test needs from a STALL repetition and its build."""

    run_dir: str
    release: str
    block_size: int
    num_blocks: int
    prompt_tokens: int
    hit_tokens: int
    request_index: int
    mechanism: tuple[tuple[str, int], ...]  # (what, line in the build's scheduler.py)


def mechanism_lines(source: str) -> tuple[tuple[str, int], ...]:
    """The lines of the stall's mechanism in a Scheduler source (``ast``: they move every release)."""
    tree = ast.parse(source)
    scheduler = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler"), None)
    if scheduler is None:
        raise KvreproError(f"{SCHEDULER}: no class Scheduler")
    methods = {n.name: n for n in scheduler.body if isinstance(n, ast.FunctionDef)}

    def call_line(method: str, owner: str, name: str, arg: str | None = None) -> int | None:
        for node in ast.walk(methods[method]) if method in methods else ():
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
                    and ast.unparse(node.func.value) == owner
                    and (arg is None or [ast.unparse(a) for a in node.args] == [arg])):
                return node.lineno
        return None

    def none_check(method: str, after: int | None) -> int | None:
        """The first ``if new_blocks is None:`` below line ``after`` (the waiting queue's, not the running's)."""
        lines = sorted(node.lineno for node in (ast.walk(methods[method]) if method in methods else ())
                       if isinstance(node, ast.If) and ast.unparse(node.test) == "new_blocks is None")
        return next((line for line in lines if after is not None and line > after), None)

    freed = ("its blocks are freed: `self.kv_cache_manager.free(request)` in _update_waiting_for_remote_kv",
             call_line("_update_waiting_for_remote_kv", "self.kv_cache_manager", "free", "request"))
    failed = ("the failed load: `_handle_failed_recving` sets its computed tokens to 0",
              methods["_handle_failed_recving"].lineno if "_handle_failed_recving" in methods else None)
    reserve = call_line("schedule", "self", "_inflight_prefill_reserved_blocks")
    counted = ("`_inflight_prefill_reserved_blocks` counts it, though it holds no blocks",
               methods["_inflight_prefill_reserved_blocks"].lineno if "_inflight_prefill_reserved_blocks" in methods
               else None)
    if "_reserve_parked" in methods:  # 0.34.0: an async load's share is a parked reservation
        found = [
            ("the async load is admitted and parked: `self._reserve_parked(request)` in schedule()",
             call_line("schedule", "self", "_reserve_parked", "request")),
            failed, freed,
            ("and it is parked again with its whole sequence at promotion: `self._reserve_parked(request)` in "
             "_handle_blocked_waiting_request", call_line("_handle_blocked_waiting_request", "self", "_reserve_parked",
                                                          "request")),
            counted,
            ("the retry's async admission reserves `self._inflight_prefill_reserved_blocks()`", reserve),
        ]
    else:
        found = [
            ("the async load is admitted: `self._inflight_prefills.add(request)` in schedule()",
             call_line("schedule", "self._inflight_prefills", "add", "request")),
            failed, (freed[0] + ", and nothing removes it from _inflight_prefills", freed[1]), counted,
            ("the retry's async admission reserves `self._inflight_prefill_reserved_blocks()`", reserve),
        ]
    found.append(("allocate_slots fails: `if new_blocks is None:` ... break ends the pass", none_check("schedule", reserve)))
    missing = [what for what, line in found if line is None]
    if missing:
        raise KvreproError(f"{SCHEDULER}: the stall's mechanism is not where kvrepro looks for it ({missing[0]}); "
                           "this release may not have it")
    return tuple((what, int(line)) for what, line in found)  # type: ignore[arg-type]


def stall_case(run_dir: Path, release: str, scheduler_source: str, block_size: int, num_blocks: int) -> StallCase:
    """The stuck request of a STALL repetition (its folder): the recomputed failed load with the
    longest prompt (the one whose blocks can exceed half the pool), from the engine log's
    ``kvrepro-fault:`` lines and the trace."""
    from ..classify import open_log, parse_log
    from ..loadgen.trace import read_trace

    failed: tuple[tuple[int | None, str | None], ...] = ()
    if (run_dir / "engine.log").is_file():  # the one parser's report (kvrepro/classify/report.py)
        with open_log(run_dir / "engine.log") as stream:
            failed = parse_log(stream).failed_loads
    recomputed = [index for index, policy in failed if policy == "recompute" and index is not None]
    if not recomputed:
        raise SpecError(f"{run_dir}: STALL, but its engine log has no injected load failure under "
                        "kv_load_failure_policy: recompute; only recompute-failed-load-stall's stall is emitted")
    requests = {r.index: r for r in read_trace(run_dir / "trace.jsonl").requests}
    known = [i for i in recomputed if i in requests]
    if not known:
        raise SpecError(f"{run_dir}/trace.jsonl: no request {', '.join(map(str, recomputed))} (the failed loads')")
    index = max(known, key=lambda i: len(requests[i].tokens))
    prompt = len(requests[index].tokens)
    hit = max(block_size, (prompt - 1) // block_size * block_size)  # every full block: the store held them
    return StallCase(str(run_dir), release, block_size, num_blocks, prompt, hit, index,
                     mechanism_lines(scheduler_source))


def _docstring(case: StallCase, skeleton_doc: str) -> str:
    head, _, _ = skeleton_doc.partition("The mechanism (")
    lines = "\n".join(f"{n}. {what} (:{line})" for n, (what, line) in enumerate(case.mechanism, 1))
    rest = skeleton_doc[skeleton_doc.index("The stall needs"):]
    lines = "\n".join(textwrap.fill(line, 100, subsequent_indent="   ") for line in lines.splitlines())
    seen = textwrap.fill(
        f"Seen by kvrepro in {case.run_dir}: request {case.request_index} of the load ({case.prompt_tokens} prompt "
        f"tokens, {case.block_size}-token blocks, a {case.num_blocks}-block pool) stalled the engine after its load "
        "failed. The model there was hybrid with MTP; this test uses vLLM's test model (one full-attention group), "
        "which counts the reservation the same way.", 100)
    return f"{head}The mechanism, in vLLM {case.release}'s {SCHEDULER}:\n\n{lines}\n\n{rest}\n{seen}\n"


def render_stall_test(case: StallCase) -> str:
    """The test's source: the skeleton with the case's values. Each top-level statement of the
    skeleton's tree is kept as the skeleton's own text (formatting and comments intact) or, for the
    docstring and the constants, replaced by the unparsed new node; the result is parsed back and its
    constants compared with the case's before it is returned."""
    source = SKELETON.read_text()
    tree = ast.parse(source)
    values = {"RUN": case.run_dir, "MECHANISM_RELEASE": case.release, "BLOCK_SIZE": case.block_size,
              "NUM_BLOCKS": case.num_blocks, "PROMPT_TOKENS": case.prompt_tokens, "HIT_TOKENS": case.hit_tokens,
              "MECHANISM": " ".join(f"({n}) {what}: scheduler.py:{line}." for n, (what, line)
                                    in enumerate(case.mechanism, 1))}
    doc = tree.body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
        raise KvreproError(f"{SKELETON}: no module docstring")
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    done = 0  # lines of the skeleton written so far
    seen = set()
    for node in tree.body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        out.append("".join(lines[done:first]))  # the skeleton's own blank lines and comments between statements
        if node is doc:
            new: ast.stmt | None = ast.Module([ast.Expr(ast.Constant(_docstring(case, doc.value.value)))], [])
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
              and node.targets[0].id in values):
            seen.add(node.targets[0].id)
            new = ast.Assign([ast.Name(node.targets[0].id, ast.Store())], ast.Constant(values[node.targets[0].id]),
                             lineno=node.lineno)
        else:
            new = None
        out.append(ast.unparse(new) + "\n" if new is not None else "".join(lines[first:node.end_lineno]))
        done = node.end_lineno or first + 1
    out.append("".join(lines[done:]))
    if seen != set(values):
        raise KvreproError(f"{SKELETON}: no module-level {', '.join(sorted(set(values) - seen))}")
    text = "".join(out)
    written = {n.targets[0].id: n.value.value for n in ast.parse(text).body  # what is written parses, and says it
               if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Constant)}
    if any(written.get(name) != value for name, value in values.items()):
        raise KvreproError(f"{SKELETON}: the rendered test does not carry the case's values")
    return text


def emit_stall_test(path: Path, case: StallCase) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_stall_test(case))


def case_json(case: StallCase) -> str:
    return json.dumps({"run": case.run_dir, "release": case.release, "request": case.request_index,
                       "prompt_tokens": case.prompt_tokens, "block_size": case.block_size,
                       "num_blocks": case.num_blocks, "mechanism": [list(m) for m in case.mechanism]})
