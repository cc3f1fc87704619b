"""Tests of kvrepro.classify: crash signatures from engine logs, and the probe's exposure counts.

The logs under tests/data/logs/ are written in the formats vLLM 0.26.0 really prints (its logger
format and NewLineFormatter, ``decorate_logs`` process prefixes, ``docker logs -t``); the
source lines their tracebacks show are 0.26.0's own at those line numbers. Nothing here runs an
engine: the logs are the input.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrepro.classify import classify_file, classify_log, known_patterns, match_pattern, read_exposure
from kvrepro.classify.lines import split_line
from kvrepro.classify.classifier import classify_with_traceback
from kvrepro.classify.records import Classification
from kvrepro.records import Outcome
from kvrepro.spec.matrix import TargetSignature

LOGS = Path(__file__).parent / "data" / "logs"
SCHED = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
TARGET_TITLE = (
    "AssertionError in update_state_after_alloc: "
    "num_locally_computed_tokens <= num_locally_computed_gpu_blocks * tokens_per_block"
)


def read(name: str) -> str:
    return (LOGS / name).read_text()


# --------------------------------------------------------------------------- the sample logs

@pytest.mark.parametrize(
    "name, outcome, title, function, file, line",
    [
        # (1) the GPU-free engine: logger header on every traceback line, EngineDeadError after
        ("sim-target.log", Outcome.TARGET, TARGET_TITLE, "update_state_after_alloc", SCHED, 816),
        # (1') captured from a real run of kvrepro's GPU-free engine on pristine vLLM 0.26.0,
        # driven by kvrepro.loadgen with the default matrix's load (probe frame in the stack)
        ("sim-engine-captured.log", Outcome.TARGET, TARGET_TITLE, "update_state_after_alloc", SCHED, 816),
        # (2) vllm serve 0.26: (EngineCore_DP0 pid=..) prefixes, API-server lines interleaved
        # into the engine's traceback, the same exception printed again raw by multiprocessing
        ("serve-0.26-target.log", Outcome.TARGET, TARGET_TITLE, "update_state_after_alloc", SCHED, 816),
        # (2') vllm serve 0.25.1 through kvrepro's sim target: the assertion names the block size
        # `gpu_block_size` there; the same crash, recognised by what it compares
        ("serve-0.25.1-target.log", Outcome.TARGET, TARGET_TITLE, "update_state_after_alloc", SCHED, 734),
        # (2'') vllm serve 0.28.0 whose EngineCore asked the executor an RPC it had no answer for:
        # the input thread's uncaught exception is the cause, not the "thread died" that follows
        ("serve-0.28-rpc-missing.log", Outcome.INFRA,
         "NotImplementedError in supports_draft_weight_updates: worker_support: list[bool] = self.collective_rpc(",
         "supports_draft_weight_updates", "vllm/v1/executor/abstract.py", 298),
        # (3) docker logs -t with colours (the container had a tty)
        ("docker-t-target.log", Outcome.TARGET, TARGET_TITLE, "update_state_after_alloc", SCHED, 816),
        # (5) chains: an exception being handled is not the cause ...
        ("chained-context.log", Outcome.TARGET, TARGET_TITLE, "update_state_after_alloc", SCHED, 816),
        # ... but `raise ... from exc` names its cause
        ("chained-cause.log", Outcome.OTHER_CRASH, "AssertionError in _apply_cow: block_idx < len(req_blocks)",
         "_apply_cow", "vllm/v1/core/single_type_kv_cache_manager.py", 396),
        # (6) the other crashes seen with this setup
        ("build-store-jobs.log", Outcome.OTHER_CRASH,
         "AssertionError in _build_store_jobs: len(offload_keys) == len(offload_block_ids)",
         "_build_store_jobs", SCHED, 975),
        ("apply-cow.log", Outcome.OTHER_CRASH, "AssertionError in _apply_cow: block_idx < len(req_blocks)",
         "_apply_cow", "vllm/v1/core/single_type_kv_cache_manager.py", 396),
        ("pr52807-alignment.log", Outcome.OTHER_CRASH,
         "AssertionError in update_state_after_alloc: num_locally_computed_tokens % tokens_per_block == 0",
         "update_state_after_alloc", SCHED, 821),
        ("infra-module-not-found.log", Outcome.INFRA, "ModuleNotFoundError: No module named 'xgrammar'",
         "<module>", "vllm/v1/structured_output/backend_xgrammar.py", 9),
        ("engine-failed-to-start.log", Outcome.INFRA,
         "ValueError in check_enough_kv_cache_memory: No available memory for the cache blocks. "
         "Try increasing `gpu_memory_utilization` when initializing the engine.",
         "check_enough_kv_cache_memory", "vllm/v1/core/kv_cache_utils.py", 702),
        # the log ends inside the fatal traceback: a crash, but not provably the target
        ("truncated.log", Outcome.OTHER_CRASH, "crash in update_state_after_alloc (traceback cut off)",
         "update_state_after_alloc", "vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py", 149),
    ],
)
def test_sample_logs(name, outcome, title, function, file, line):
    result = classify_file(LOGS / name)
    assert (result.outcome, result.title) == (outcome, title)
    assert result.signature is not None
    assert (result.signature.function, result.signature.file, result.signature.line) == (function, file, line)
    # the string API gives the same answer as the streaming one
    assert classify_log(read(name)) == result


def test_sigterm_of_a_healthy_vllm_serve_is_no_crash():
    """vLLM 0.27's API server logs an EngineDeadError while it shuts down on SIGTERM: not a crash."""
    text = read("serve-0.27-clean-stop.log")
    assert "[shutdown] API server: shutdown triggered" in text and "EngineDeadError" in text
    assert classify_log(text) == Classification(Outcome.NONE, "no crash", None)
    # the same death report without the orderly stop before it stays a crash of unknown cause
    cut = "\n".join(line for line in text.splitlines() if "[shutdown]" not in line and "Shutting down" not in line)
    assert classify_log(cut).title == "EngineDeadError: engine died, root cause not in the log"


def test_a_teardown_race_after_the_stop_began_is_no_crash():
    """psutil's ZombieProcess raised while vllm serve 0.26 tears down after 600 good requests."""
    text = read("serve-0.26-zombie-at-stop.log")
    assert "psutil.ZombieProcess" in text
    assert classify_log(text).outcome is Outcome.NONE
    # before the stop began, the same traceback would be an unexpected crash
    early = "\n".join(line for line in text.splitlines() if "[shutdown]" not in line and "Shutting down" not in line)
    assert classify_log(early).outcome is Outcome.OTHER_CRASH


def test_renamed_identifiers_compare_equal_other_statements_do_not():
    from kvrepro.classify.source import canonical

    old = "assert (\n    num_locally_computed_tokens\n    <= num_locally_computed_gpu_blocks * gpu_block_size\n)"
    assert canonical(old) == canonical(TARGET_TITLE.split(": ", 1)[1])
    assert canonical("<= num_locally_computed_gpu_blocks * gpu_block_size") == \
        "<= num_locally_computed_gpu_blocks * tokens_per_block"
    # another comparison of the same names is another assertion
    assert canonical("num_locally_computed_tokens < num_locally_computed_gpu_blocks * gpu_block_size") != \
        canonical(old)
    assert canonical("num_locally_computed_tokens % gpu_block_size == 0") != canonical(old)


def test_clean_log_is_no_crash():
    result = classify_file(LOGS / "clean.log")
    assert result.outcome is Outcome.NONE
    assert result.signature is None


def test_target_signature_fields_without_source():
    sig = classify_file(LOGS / "serve-0.26-target.log").signature
    assert sig.exception == "AssertionError"
    # Python 3.11/3.12 print one line of the wrapped assert; without the source that is all we have
    assert sig.expression == "num_locally_computed_tokens"


# --------------------------------------------------------------------------- (4) source resolution

def _source_tree(root: Path, statement: str, first_line: int = 815) -> Path:
    """A stand-in for a build's ``vllm/`` tree: the statement at the line 0.26.0 has it."""
    path = root / SCHED
    path.parent.mkdir(parents=True)
    head = ["class OffloadingConnectorScheduler:", "    def update_state_after_alloc(self):"]
    filler = [f"        # line {i}" for i in range(len(head) + 1, first_line)]
    path.write_text("\n".join([*head, *filler, statement, "        return None", ""]))
    return root


ASSERT_0260 = """\
        assert (
            num_locally_computed_tokens
            <= num_locally_computed_gpu_blocks * tokens_per_block
        )"""


def test_source_resolves_whole_multiline_assert(tmp_path):
    root = _source_tree(tmp_path, ASSERT_0260)
    assert (root / SCHED).read_text().splitlines()[815].strip() == "num_locally_computed_tokens"
    result = classify_file(LOGS / "sim-target.log", source_root=root)
    assert result.signature.expression == (
        "num_locally_computed_tokens <= num_locally_computed_gpu_blocks * tokens_per_block"
    )
    assert result.title == TARGET_TITLE
    assert result.outcome is Outcome.TARGET


def test_source_of_another_build_is_not_trusted(tmp_path):
    """The traceback shows `num_locally_computed_tokens` at line 816; a tree with something else
    there is not the build that crashed, so the shown text is kept."""
    root = _source_tree(tmp_path, "        assert (\n            other_thing\n            <= 3\n        )")
    result = classify_file(LOGS / "sim-target.log", source_root=root)
    assert result.signature.expression == "num_locally_computed_tokens"
    assert result.title == TARGET_TITLE  # the pattern still knows the fragment


def test_source_resolution_of_a_statement_spanning_lines(tmp_path):
    log = _engine_log([
        'File "/x/vllm/v1/core/sched/scheduler.py", line 3, in schedule',
        "    req_blocks[block_idx],",
    ], "IndexError: list index out of range")
    src = tmp_path / "vllm/v1/core/sched/scheduler.py"
    src.parent.mkdir(parents=True)
    src.write_text("def schedule():\n    foo(\n        req_blocks[block_idx],\n        other,\n    )\n")
    result = classify_log(log, source_root=tmp_path)
    assert result.signature.expression == "foo(req_blocks[block_idx], other,)"
    assert result.title == "IndexError in schedule: foo(req_blocks[block_idx], other,)"


# --------------------------------------------------------------------------- the signature table

def test_every_pattern_has_a_test_log_that_yields_its_title():
    patterns = known_patterns()
    assert {p.name for p in patterns} >= {
        "offload_update_state_after_alloc", "offload_boundary_alignment", "offload_build_store_jobs",
        "kv_cache_apply_cow",
    }
    for pattern in patterns:
        assert pattern.test_log, f"pattern {pattern.name} names no test log"
        path = LOGS / pattern.test_log
        assert path.is_file(), f"pattern {pattern.name}: {path} missing"
        assert pattern.why and pattern.expressions
        result = classify_file(path)
        # a pattern with a message regex is matched with the exception's message, as classify does
        _, tb = classify_with_traceback(path.read_text())
        message = tb.root().message if tb is not None else ""
        assert match_pattern(result.signature, message) is pattern, pattern.name
        assert result.title == pattern.render_title(result.signature)


def test_whole_expression_beats_a_fragment():
    """`num_locally_computed_tokens` is one line of the target assert and also part of the
    pr-52807 one; the single-line pr-52807 assert is shown whole, so it must not fall to the
    target pattern."""
    sig = classify_file(LOGS / "pr52807-alignment.log").signature
    assert match_pattern(sig).name == "offload_boundary_alignment"
    frag = classify_file(LOGS / "sim-target.log").signature
    assert match_pattern(frag).name == "offload_update_state_after_alloc"


def test_unknown_crash_gets_generic_title():
    log = _engine_log([
        'File "/opt/venv/lib/python3.12/site-packages/vllm/v1/core/block_pool.py", line 300, in free_blocks',
        "    block.ref_cnt -= 1",
        'File "/opt/venv/lib/python3.12/site-packages/torch/_ops.py", line 10, in __call__',
        "    return self._op(*args)",
    ], "KeyError: 17")
    result = classify_log(log)
    assert result.outcome is Outcome.OTHER_CRASH
    assert result.title == "KeyError in free_blocks: block.ref_cnt -= 1"
    assert result.signature.file == "vllm/v1/core/block_pool.py"  # innermost *vLLM* frame
    assert match_pattern(result.signature) is None


def test_crash_outside_vllm_names_the_file_without_machine_paths():
    log = _engine_log([
        'File "/home/someone/src/kvrepro/engine/core.py", line 50, in _step',
        "    self.fake_worker.run(out)",
    ], "TypeError: 'NoneType' object is not iterable")
    result = classify_log(log)
    assert result.outcome is Outcome.OTHER_CRASH
    assert result.signature.file == "kvrepro/engine/core.py"
    assert result.title == "TypeError in _step: self.fake_worker.run(out)"


# --------------------------------------------------------------------------- target matching

def test_custom_target_signature():
    target = TargetSignature(exception="AssertionError", function="_apply_cow",
                             file="vllm/v1/core/single_type_kv_cache_manager.py")
    assert classify_file(LOGS / "apply-cow.log", target=target).outcome is Outcome.TARGET
    assert classify_file(LOGS / "serve-0.26-target.log", target=target).outcome is Outcome.OTHER_CRASH


def test_exception_must_match_for_target():
    log = read("sim-target.log").replace("[core.py:219] AssertionError", "[core.py:219] KeyError: 3")
    result = classify_log(log)
    assert result.outcome is Outcome.OTHER_CRASH
    assert result.title.startswith("KeyError in update_state_after_alloc")


# --------------------------------------------------------------------------- infra / none

def test_raw_crash_before_startup_is_infra_after_is_a_crash():
    tb = [
        "Traceback (most recent call last):",
        '  File "/x/vllm/config/cache.py", line 12, in __post_init__',
        "    raise ValueError(f\"bad block size {self.block_size}\")",
        "ValueError: bad block size 7",
    ]
    before = "\n".join(["INFO 11-29 10:00:00 [api_server.py:1836] vLLM API server version 0.26.0", *tb])
    assert classify_log(before).outcome is Outcome.INFRA
    after = "\n".join(["INFO:     Application startup complete.", *tb])
    result = classify_log(after)
    assert result.outcome is Outcome.OTHER_CRASH
    assert result.title == "ValueError in __post_init__: bad block size 7"


def test_argparse_error_is_infra():
    log = ("usage: vllm serve [model_tag] [options]\n"
           "vllm serve: error: argument --mamba-cache-mode: invalid choice: 'aligned'\n")
    result = classify_log(log)
    assert result.outcome is Outcome.INFRA
    assert "invalid choice" in result.title


def test_error_without_traceback_before_startup_is_infra():
    """The GPU-free engine logs a bad setup as one ERROR line and exits before serving."""
    log = ("INFO 11-29 10:00:00 [server.py:260] kvrepro sim engine: vLLM 0.26.0\n"
           "ERROR 11-29 10:00:01 [server.py:279] --mamba-cache-mode align needs a model with Mamba layers\n")
    result = classify_log(log)
    assert (result.outcome, result.title) == (
        Outcome.INFRA, "engine did not start: --mamba-cache-mode align needs a model with Mamba layers")
    # once the server was up, an ERROR line alone is not a crash
    assert classify_log("INFO:     Application startup complete.\n" + log).outcome is Outcome.NONE


def test_handled_logged_error_is_not_a_crash():
    """vLLM logs some request errors with a traceback and keeps serving."""
    log = "\n".join([
        "INFO:     Application startup complete.",
        "ERROR 11-29 10:00:00 [serving.py:300] Error in preprocessing prompt inputs",
        "ERROR 11-29 10:00:00 [serving.py:300] Traceback (most recent call last):",
        'ERROR 11-29 10:00:00 [serving.py:300]   File "/x/vllm/entrypoints/openai/serving.py", line 10, in f',
        "ERROR 11-29 10:00:00 [serving.py:300]     raise ValueError(msg)",
        "ERROR 11-29 10:00:00 [serving.py:300] ValueError: prompt too long",
        'INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 400 Bad Request',
        'INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK',
    ])
    assert classify_log(log).outcome is Outcome.NONE


def test_shutdown_tracebacks_are_not_crashes():
    """Ctrl-C / SIGTERM make uvicorn and asyncio print tracebacks; the run itself was fine."""
    log = "\n".join([
        read("clean.log"),
        "(APIServer pid=1) Traceback (most recent call last):",
        '(APIServer pid=1)   File "/usr/lib/python3.12/asyncio/runners.py", line 118, in run',
        "(APIServer pid=1)     return self._loop.run_until_complete(task)",
        "(APIServer pid=1) asyncio.exceptions.CancelledError",
        "(APIServer pid=1) ",
        "(APIServer pid=1) During handling of the above exception, another exception occurred:",
        "(APIServer pid=1) ",
        "(APIServer pid=1) Traceback (most recent call last):",
        '(APIServer pid=1)   File "/usr/local/bin/vllm", line 10, in <module>',
        "(APIServer pid=1)     sys.exit(main())",
        "(APIServer pid=1) KeyboardInterrupt",
    ])
    assert classify_log(log).outcome is Outcome.NONE


def test_engine_dead_without_root_cause():
    log = "\n".join([
        "INFO:     Application startup complete.",
        "ERROR 11-29 10:00:07 [async_llm.py:704] AsyncLLM output_handler failed.",
        "ERROR 11-29 10:00:07 [async_llm.py:704] Traceback (most recent call last):",
        'ERROR 11-29 10:00:07 [async_llm.py:704]   File "/x/vllm/v1/engine/core_client.py", line 856, in get_output_async',
        "ERROR 11-29 10:00:07 [async_llm.py:704]     raise self._format_exception(outputs) from None",
        "ERROR 11-29 10:00:07 [async_llm.py:704] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
    ])
    result = classify_log(log)
    assert result.outcome is Outcome.OTHER_CRASH
    assert result.title == "EngineDeadError: engine died, root cause not in the log"


def test_cut_logged_traceback_falls_back_to_the_raw_copy():
    """The engine's logged traceback lost its last line, but multiprocessing printed it again."""
    text = read("serve-0.26-target.log")
    cut = "(EngineCore_DP0 pid=245) ERROR 11-29 10:04:12 [core.py:1332] AssertionError\n"
    assert cut in text
    result = classify_log(text.replace(cut, "", 1))
    assert (result.outcome, result.title) == (Outcome.TARGET, TARGET_TITLE)


def test_undecodable_bytes_are_replaced(tmp_path):
    path = tmp_path / "engine.log"
    path.write_bytes(b"\xff\xfe garbage \x80\n" + (LOGS / "sim-target.log").read_bytes())
    assert classify_file(path).outcome is Outcome.TARGET


def test_secrets_never_reach_titles():
    log = "\n".join([
        "HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz0123",
        "Traceback (most recent call last):",
        '  File "/x/vllm/transformers_utils/config.py", line 3, in get_config',
        "    import secret_module",
        "ModuleNotFoundError: No module named 'x' (token=hf_abcdefghijklmnopqrstuvwxyz0123)",
    ])
    result = classify_log(log)
    assert result.outcome is Outcome.INFRA
    assert "hf_abc" not in result.title and "hf_abc" not in repr(result.signature)


def test_a_large_log_with_an_absurd_line_still_gives_its_crash(tmp_path):
    """Logs of long runs reach 100+ MB of access lines, and a line of megabytes: the crash after them
    is found. How fast is benchmarks/triage_large_log.py's question (a timed assertion here failed
    whenever the machine was loaded)."""
    path = tmp_path / "big.log"
    noise = '(APIServer pid=1) INFO:     172.17.0.1:40001 - "POST /v1/completions HTTP/1.1" 200 OK\n' * 1000
    with open(path, "w") as fh:
        for _ in range(200):  # ~17 MB
            fh.write(noise)
        fh.write("(APIServer pid=1) " + "x" * 2_000_000 + "\n")  # one absurd line
        fh.write(read("serve-0.26-target.log"))
    result = classify_file(path)
    assert result.title == TARGET_TITLE


# --------------------------------------------------------------------------- line splitting

@pytest.mark.parametrize(
    "raw, stream, header, body",
    [
        ("ERROR 11-29 10:00:00 [core.py:1332] Traceback (most recent call last):\r\n",
         "", "ERROR 11-29 10:00:00 [core.py:1332]", "Traceback (most recent call last):"),
        ("(EngineCore_DP0 pid=1234) ERROR 11-29 10:00:00 [core.py:1332]     num_locally_computed_tokens\r",
         "EngineCore_DP0 pid=1234", "ERROR 11-29 10:00:00 [core.py:1332]", "    num_locally_computed_tokens"),
        ("(EngineCore pid=339) ERROR 08-19 10:11:55 [core.py:1348]", "EngineCore pid=339",
         "ERROR 08-19 10:11:55 [core.py:1348]", ""),
        ("2025-11-29T10:04:12.123456789Z (APIServer pid=1) INFO:     Application startup complete.",
         "APIServer pid=1", None, "INFO:     Application startup complete."),
        ("vllm-1  | (APIServer pid=1) INFO 11-29 10:00:00 [a.py:1] hi", "APIServer pid=1",
         "INFO 11-29 10:00:00 [a.py:1]", "hi"),
        ("\x1b[36m(APIServer pid=1)\x1b[0m \x1b[31mERROR\x1b[0m \x1b[90m11-29 10:00:00\x1b[0m "
         "\x1b[90m[entrypoints/.../serving.py:1267]\x1b[0m   File \"x\", line 1, in f",
         "APIServer pid=1", "ERROR 11-29 10:00:00 [entrypoints/.../serving.py:1267]", '  File "x", line 1, in f'),
        ("  File \"/a | b.py\", line 3, in f", "", None, '  File "/a | b.py", line 3, in f'),
        # seen 2026-12-04 (suite-20261204-183540-8c2c, 2 of ~190 engine logs): the fatal error's first line
        # with the API server's prefix in front of the forked EngineCore's; the record is EngineCore's
        ("(APIServer pid=8053) (EngineCore pid=8066) ERROR 12-04 19:04:24 [core.py:1233] EngineCore encountered a "
         "fatal error.", "EngineCore pid=8066", "ERROR 12-04 19:04:24 [core.py:1233]",
         "EngineCore encountered a fatal error."),
    ],
)
def test_split_line(raw, stream, header, body):
    line = split_line(1, raw)
    assert (line.stream, line.header, line.body) == (stream, header, body)


# --------------------------------------------------------------------------- exposure

INSTALLED = ("kvrepro-probe: installed function=OffloadingConnectorScheduler.update_state_after_alloc "
             "file=/x/vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py source_sha256=" + "ab" * 32)


def test_exposure_last_counts_line_wins():
    log = "\n".join([INSTALLED,
                     "kvrepro-probe: counts external_hit_calls=3 trigger_calls=1",
                     "kvrepro-probe: counts external_hit_calls=9 trigger_calls=4"])
    exp = read_exposure(log)
    assert (exp.external_hit_calls, exp.trigger_calls, exp.probe_seen) == (9, 4, True)
    assert exp.probe_source_sha256 == "ab" * 32


def test_exposure_sums_last_line_of_each_process():
    log = "\n".join([
        f"2025-11-29T10:00:00Z (EngineCore_DP0 pid=10) {INSTALLED}",
        f"2025-11-29T10:00:00Z (EngineCore_DP1 pid=11) {INSTALLED}",
        "2025-11-29T10:00:01Z (EngineCore_DP0 pid=10) kvrepro-probe: counts external_hit_calls=2 trigger_calls=1",
        "2025-11-29T10:00:01Z (EngineCore_DP1 pid=11) kvrepro-probe: counts external_hit_calls=5 trigger_calls=0",
        "2025-11-29T10:00:02Z (EngineCore_DP0 pid=10) kvrepro-probe: counts external_hit_calls=7 trigger_calls=3",
    ])
    exp = read_exposure(log)
    assert (exp.external_hit_calls, exp.trigger_calls) == (12, 3)


def test_exposure_takes_the_larger_of_log_and_metrics():
    log = f"{INSTALLED}\nkvrepro-probe: counts external_hit_calls=5 trigger_calls=2\n"
    metrics = ("# HELP kvrepro_probe_trigger_calls_total calls with a local and an offload hit\n"
               "# TYPE kvrepro_probe_trigger_calls_total counter\n"
               "kvrepro_probe_external_hit_calls_total 4.0\n"
               "kvrepro_probe_trigger_calls_total 6.0\n")
    exp = read_exposure(log, metrics)
    assert (exp.external_hit_calls, exp.trigger_calls) == (5, 6)


def test_exposure_without_probe():
    exp = read_exposure(read("infra-module-not-found.log"), "kvrepro_probe_trigger_calls_total 0\n")
    assert (exp.probe_seen, exp.trigger_calls, exp.external_hit_calls, exp.probe_source_sha256) == (False, 0, 0, None)


def test_exposure_from_sample_logs():
    captured = read_exposure(read("sim-engine-captured.log"))
    assert (captured.probe_seen, captured.external_hit_calls, captured.trigger_calls) == (True, 8, 3)
    exp = read_exposure(read("serve-0.26-target.log"))
    assert exp.probe_seen and (exp.external_hit_calls, exp.trigger_calls) == (40, 6)
    assert read_exposure(read("docker-t-target.log")) == exp


# --------------------------------------------------------------------------- helpers

def _engine_log(frames: list[str], exception: str) -> str:
    """A minimal GPU-free-engine log: started, then a fatal error with the given frames."""
    lines = ["INFO:     Application startup complete.",
             "ERROR 11-29 10:00:07 [core.py:219] EngineCore encountered a fatal error.",
             "ERROR 11-29 10:00:07 [core.py:219] Traceback (most recent call last):"]
    for f in frames:
        lines.append("ERROR 11-29 10:00:07 [core.py:219] " + (f if f.startswith(" ") else "  " + f))
    lines.append("ERROR 11-29 10:00:07 [core.py:219] " + exception)
    return "\n".join(lines) + "\n"


def test_engine_counters_last_line_of_each_process_and_unknown_without_one():
    from kvrepro.classify import read_engine_counters
    from kvrepro.classify.records import EngineCounters

    log = ("(EngineCore pid=7) INFO 11-30 14:08:53 [executor.py:413] kvrepro-sim: counts steps=5 "
           "offload_load_jobs=1 offload_store_jobs=2 pid=7\n"
           "(EngineCore pid=7) INFO 11-30 14:08:55 [executor.py:413] kvrepro-sim: counts steps=50 "
           "offload_load_jobs=10 offload_store_jobs=20 pid=7\n"
           "kvrepro-sim: counts steps=3 offload_load_jobs=1 offload_store_jobs=1 pid=9\n")
    assert read_engine_counters(log) == EngineCounters(steps=53, offload_load_jobs=11, offload_store_jobs=21)
    assert read_engine_counters(read("serve-0.26-target.log")) == EngineCounters()  # unknown, not zero


def test_probe_counts_of_unprefixed_processes_are_kept_apart_by_pid():
    """vLLM 0.33 does not prefix a child's raw stderr: the API server's zeros must not win."""
    log = ("kvrepro-probe: counts external_hit_calls=520 trigger_calls=52 pid=11\n"
           "kvrepro-probe: counts external_hit_calls=0 trigger_calls=0 pid=10\n")
    exposure = read_exposure(log)
    assert (exposure.external_hit_calls, exposure.trigger_calls) == (520, 52)


# --------------------------------------------------------------------------- evidence: state + shadow KV

def test_exposure_reads_the_bugs_state_and_the_shadow_kv():
    log = "\n".join([
        INSTALLED,
        "kvrepro-probe: counts external_hit_calls=3 trigger_calls=1 state_calls=0 state_groups=- pid=12",
        "kvrepro-shadow: installed groups=0:mamba/16,1:full_attention/16",
        "kvrepro-shadow: violation step=9 request r1 group 1 (full_attention) block index 5: missing",
        "kvrepro-shadow: violation step=12 request r2 group 0 (mamba) block index 2: null block",
        "kvrepro-shadow: counts checks=40 violations=2 by=full_attention:1,mamba+offload:1",
        "kvrepro-probe: counts external_hit_calls=9 trigger_calls=4 state_calls=3 state_groups=full_attention:3,mamba:1 "
        "pid=12",
    ])
    exp = read_exposure(log)
    assert (exp.trigger_calls, exp.state_calls, exp.state_groups) == (4, 3, {"full_attention": 3, "mamba": 1})
    assert (exp.kv_checks, exp.kv_violations, exp.kv_check) == (40, 2, "corrupt")
    assert exp.kv_violations_by == {"full_attention": 1, "mamba+offload": 1}
    assert exp.kv_first_violation == "step=9 request r1 group 1 (full_attention) block index 5: missing"
    # an older probe's line (no state fields) still reads, as no state evidence
    old = read_exposure(f"{INSTALLED}\nkvrepro-probe: counts external_hit_calls=2 trigger_calls=1\n")
    assert (old.trigger_calls, old.state_calls, old.state_groups, old.kv_check) == (1, 0, {}, "off")
    assert (exp.deferred_lookups, exp.loads_behind_deferred, old.deferred_lookups) == (0, 0, 0)


def test_exposure_reads_the_waiting_queue_stall_counts_per_process():
    """deferred_lookups / loads_behind_deferred: the last line of each process, added up; a line
    without them (an older probe) reads as zero."""
    log = "\n".join([
        INSTALLED,
        "kvrepro-probe: counts external_hit_calls=3 trigger_calls=1 state_calls=0 state_groups=- "
        "deferred_lookups=4 loads_behind_deferred=1 pid=12",
        "kvrepro-probe: counts external_hit_calls=9 trigger_calls=4 state_calls=3 state_groups=mamba:1 "
        "deferred_lookups=10 loads_behind_deferred=3 pid=12",
        "kvrepro-probe: counts external_hit_calls=1 trigger_calls=0 state_calls=0 state_groups=- "
        "deferred_lookups=2 loads_behind_deferred=2 pid=13",
        "kvrepro-probe: counts external_hit_calls=0 trigger_calls=0 state_calls=0 state_groups=- pid=14",
    ])
    exp = read_exposure(log)
    assert (exp.external_hit_calls, exp.state_calls, exp.state_groups) == (10, 3, {"mamba": 1})
    assert (exp.deferred_lookups, exp.loads_behind_deferred) == (12, 5)


def test_every_probe_counter_is_read_by_its_name_from_the_table():
    """The probe's plain counters are records.PROBE_COUNTERS, read by name (any order, a name the
    table lacks skipped) into the Exposure and RunResult fields of that name, and offered by the
    suite: a new counter is a table line and two fields, not a reader change."""
    import dataclasses

    from kvrepro.classify.records import PROBE_COUNTERS, Exposure
    from kvrepro.records import RunResult
    from kvrepro.suite.catalogue import COUNTERS

    values = {name: 3 + i for i, name in enumerate(PROBE_COUNTERS)}
    tokens = " ".join(f"{name}={n}" for name, n in reversed(values.items()))
    exp = read_exposure(f"{INSTALLED}\nkvrepro-probe: counts external_hit_calls=1 trigger_calls=1 state_calls=0 "
                        f"state_groups=- a_counter_of_a_newer_probe=99 {tokens} pid=7\n")
    assert {name: getattr(exp, name) for name in PROBE_COUNTERS} == values
    fields = {f.name for f in dataclasses.fields(Exposure)} & {f.name for f in dataclasses.fields(RunResult)}
    assert set(PROBE_COUNTERS) <= fields and set(PROBE_COUNTERS) <= set(COUNTERS)


# --------------------------------------------------------------------------- honest verdicts

OTHER_ASSERT_IN_TARGET_FUNCTION = "\n".join([
    "INFO:     Application startup complete.",
    "ERROR 11-29 10:00:07 [core.py:1000] EngineCore encountered a fatal error.",
    "ERROR 11-29 10:00:07 [core.py:1000] Traceback (most recent call last):",
    f'ERROR 11-29 10:00:07 [core.py:1000]   File "/x/{SCHED}", line 807, in update_state_after_alloc',
    "ERROR 11-29 10:00:07 [core.py:1000]     assert len(group_blocks) >= num_gpu_blocks",
    "ERROR 11-29 10:00:07 [core.py:1000] AssertionError",
])


def test_classify_cli_without_matrix_uses_the_default_target_expression(tmp_path):
    """Another assertion in update_state_after_alloc is not the target, with or without --matrix."""
    import subprocess
    import sys

    log = tmp_path / "engine.log"
    log.write_text(OTHER_ASSERT_IN_TARGET_FUNCTION + "\n")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "classify", str(log), "--json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    assert got["outcome"] == "other_crash", got
    assert got["signature"]["expression"] == "len(group_blocks) >= num_gpu_blocks"
    from kvrepro.spec.matrix import default_target_signature, load_matrix

    assert default_target_signature() == load_matrix(root / "matrix.yaml").matrix.target_signature
    assert default_target_signature().expression


def test_engine_that_served_then_died_without_cause_is_a_crash_of_unknown_cause():
    """A log cut at its start (no 'Application startup complete.') that shows answered requests
    and then the engine's death without a traceback: not 'engine did not start'."""
    log = "\n".join([
        'INFO:     127.0.0.1:5000 - "POST /v1/completions HTTP/1.1" 200 OK',
        "INFO 11-29 10:01:00 [loggers.py:100] Engine 000: Avg prompt throughput: 1200.0 tokens/s",
        'INFO:     127.0.0.1:5001 - "POST /v1/completions HTTP/1.1" 200 OK',
        "ERROR 11-29 10:09:00 [core_client.py:600] Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.",
    ])
    result = classify_log(log)
    assert result.outcome is Outcome.OTHER_CRASH
    assert result.title.startswith("crash of unknown cause: the engine served, then died with no root cause")
    # the same death line in a log of an engine that never served stays a failed start
    never = classify_log(log.split("\n")[-1] + "\n")
    assert never.outcome is Outcome.INFRA and never.title.startswith("engine did not start")


def test_the_apply_cow_face_with_an_offload_hit_is_the_same_signature_under_its_own_title():
    """The second assert of ``_apply_cow`` (``req_blocks[block_idx] is source_block``, 0.26.0 :397) is
    the same defect reached with an offload hit (docs/defect-family.md 3.15); its log is run 2 of
    explore-20261202-155324-aa7f on 0.26.0, trimmed, which the campaign called new before the
    pattern knew the statement. It must match ``kv_cache_apply_cow`` in full, titled by its own text."""
    result = classify_file(LOGS / "apply-cow-source.log")
    pattern = match_pattern(result.signature)
    assert pattern is not None and pattern.name == "kv_cache_apply_cow"
    assert pattern.match(result.signature) == "full"
    assert result.title == "AssertionError in _apply_cow: req_blocks[block_idx] is source_block"
    # the first face keeps its own title
    first = classify_file(LOGS / "apply-cow.log")
    assert first.title == "AssertionError in _apply_cow: block_idx < len(req_blocks)"


def test_a_cut_statement_matches_a_pattern_naming_its_printed_line():
    """Python prints only the first line of an assert whose message is wrapped (`assert x == 0, (`):
    without the build's source the classifier marks the statement cut, and a pattern that names that
    printed line as a fragment still knows the crash (a report's traceback, vllm#45407)."""
    result = classify_file(LOGS / "simple-offload-group-alignment.log")
    assert "statement cut" in result.signature.expression
    message = "num_external_tokens=64512 not aligned to group 0 block_size=12288"  # the log's exception line
    assert match_pattern(result.signature, message).name == "simple_offload_group_alignment"
    assert result.title == "AssertionError in update_state_after_alloc: num_external_tokens % g_block_size == 0"


def test_a_process_counts_line_without_its_stream_prefix_is_still_that_process():
    """vLLM's stream decoration sometimes writes a process's line without its "(EngineCore pid=N)"
    prefix (measured on a default-matrix D run: the last shadow counts line bare, its violations read
    twice, 702 for the engine's 362). A counts line names its pid: one process, counted once."""
    log = "\n".join([
        "(EngineCore pid=41) INFO 12-04 21:31:55 [executor.py:810] kvrepro-shadow: counts checks=3000 "
        "violations=300 by=full_attention/stale/hit:300 hits=- stored=- pid=41",
        "kvrepro-shadow: counts checks=3714 violations=362 by=full_attention/stale/hit:362 hits=- stored=- pid=41",
        "kvrepro-probe: counts external_hit_calls=5 trigger_calls=2 state_calls=0 state_groups=- pid=41",
        "(EngineCore pid=41) kvrepro-probe: counts external_hit_calls=4 trigger_calls=2 state_calls=0 "
        "state_groups=- pid=41",
    ])
    exposure = read_exposure(log)
    assert (exposure.kv_checks, exposure.kv_violations) == (3714, 362)
    assert exposure.external_hit_calls == 4  # the process's last line, not the two added
