"""kvrepro triage on what people paste: partial tracebacks, quoted lines, the exception alone; the
version and configuration from command lines, JSON, calls and tool output, each with its line; a
ranking that separates siblings or says it cannot; never a refusal of text.

The texts are written here in the forms real reports take (tests/data/triage/real/ holds the real
ones, judged in tests/test_triage_corpus.py); the seed's traceback is vLLM 0.26.0's own
(tests/data/triage/README.md). In-process and cheap: no engine, one CLI call."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from kvrepro.suite.run import load as load_catalogue
from kvrepro.triage import failure as failure_module
from kvrepro.triage import render, triage_file
from kvrepro.triage.pasted import normalise, repair
from kvrepro.triage.sources import find_version, parse_flags, read_text, split_command

SEED = ROOT / "tests" / "data" / "triage" / "seed-0.26-dp4-offload-mtp.log"
_BODY = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"


@pytest.fixture(scope="module")
def catalogue():
    return load_catalogue()


def seed_traceback() -> list[str]:
    """The seed's EngineCore traceback (lines 20-38), as vLLM 0.26.0 logged it."""
    return SEED.read_text().splitlines()[19:38]


def write(tmp_path, text: str, name: str = "report.log"):
    path = tmp_path / name
    path.write_text(text)
    return path


def quoted_midway(lines: list[str]) -> str:
    """The traceback as an issue quotes it: from its fourth frame on, the docker timestamps gone,
    half its lines without the process and logger prefix, in a fenced block behind '> '."""
    body = []
    for i, line in enumerate(lines[7:]):
        text = line.split("Z ", 1)[1]
        if i % 2:
            text = text.split("[core.py:1332] ", 1)[1]
        body.append("> " + text)
    return "> ```\n" + "\n".join(body) + "\n> ```\n"


def test_a_quoted_traceback_starting_midway_names_the_entry(tmp_path, catalogue):
    text = ("We run `vllm/vllm-openai:v0.26.0` with\n\n```bash\nvllm serve Qwen/Qwen3.5-397B-A17B-FP8 \\\n"
            "  --tensor-parallel-size 4 --data-parallel-size 4 --enable-prefix-caching \\\n"
            "  --mamba-cache-mode align --kv-offloading-size 384 --kv-offloading-backend native \\\n"
            "  --speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'\n```\n\n"
            + quoted_midway(seed_traceback()))
    found = triage_file(write(tmp_path, text), catalogue)
    assert found.failure.kind == "crash" and found.failure.pattern == "offload_update_state_after_alloc"
    assert found.failure.phase == "runtime" and found.failure.outcome == "target"
    assert found.best.entry == "offload-boundary-assert" and found.tie is None, found.tie
    c = found.config
    assert (c.release, c.tensor_parallel_size, c.data_parallel_size, c.mamba_cache_mode) == ("0.26.0", 4, 4, "align")
    assert (c.kv_connector, c.speculative_method, c.num_speculative_tokens) == ("OffloadingConnector", "mtp", 1)
    assert c.source("release") == "line 1: the docker image tag"
    assert c.source("tensor_parallel_size") == "line 4: vllm serve"
    assert c.source("scheduling_policy") == "line 4: vllm serve leaves it at vLLM's default"
    assert "offload-boundary-assert-all-mode" in {m.entry for m in found.near_misses}


def test_siblings_are_separated_by_the_mode_or_reported_as_a_tie(tmp_path, catalogue):
    """offload-boundary-assert (align or all) and its all-mode sibling share the signature: the
    mode the text gives decides; without it the tie is said, with what would decide it."""
    crash = quoted_midway(seed_traceback())
    no_config = triage_file(write(tmp_path, "vllm==0.26.0\n" + crash, "a.log"), catalogue)
    assert no_config.tie is not None
    assert {"offload-boundary-assert", "offload-boundary-assert-all-mode"} <= set(no_config.tie.entries)
    assert any(d.startswith("mamba_cache_mode, which the log does not say") for d in no_config.tie.would_decide)
    assert any("not checked" in w for w in no_config.best.why)
    lines = render.plain(no_config)
    assert any(line.startswith("unresolved tie: ") for line in lines) and max(map(len, lines)) <= 80
    all_mode = triage_file(write(tmp_path, "vllm==0.26.0\nvllm serve m --mamba-cache-mode all --kv-offloading-size 8\n"
                                 + crash, "b.log"), catalogue)
    assert all_mode.best.entry == "offload-boundary-assert-all-mode" and all_mode.tie is None
    align = triage_file(write(tmp_path, "vllm==0.26.0\nvllm serve m --mamba-cache-mode align --kv-offloading-size 8\n"
                              + crash, "c.log"), catalogue)
    assert [m.entry for m in align.matches] == ["offload-boundary-assert"]
    assert dict((m.entry, m.why_not) for m in align.near_misses)["offload-boundary-assert-all-mode"] == (
        "needs mamba_cache_mode all, the log has align",)


def test_a_multiconnector_holds_each_of_its_members(tmp_path, catalogue):
    """NIXL and the OffloadingConnector under a MultiConnector: an entry that needs the offloading
    connector holds (its member runs), and the plain output says so."""
    config = json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                       {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}]}})
    text = (f"vllm==0.26.0\nvllm serve m --mamba-cache-mode align --kv-transfer-config '{config}'\n"
            + quoted_midway(seed_traceback()))
    found = triage_file(write(tmp_path, text), catalogue)
    assert found.config.connectors() == ("nixl", "offloading")
    assert found.best.entry == "offload-boundary-assert"
    assert "connector offloading (in a MultiConnector with nixl+offloading) (needs offloading)" in found.best.why


def test_the_offload_tiers(tmp_path, catalogue):
    tiering = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "secondary_tiers": [{"type": "fs", "root_dir": "/cache"}]}})
    multi = triage_file(write(tmp_path, f"vllm serve m --kv-transfer-config '{tiering}'\n", "m.log"), catalogue)
    single = triage_file(write(tmp_path, "vllm serve m --kv-offloading-size 64\n", "s.log"), catalogue)
    unread = triage_file(write(tmp_path, "AssertionError\n", "u.log"), catalogue)
    assert [t.config.facets()["offload_tiers"] for t in (multi, single, unread)] == ["multi", "single", "unknown"]


def test_another_assertion_in_the_same_function_is_not_the_target(tmp_path, catalogue):
    """vllm#46014's statement in update_state_after_alloc: not target, no entry, the function's
    entries as near misses saying what differs."""
    text = (f'Traceback (most recent call last):\n  File "/usr/lib/python3/dist-packages/{_BODY}", line 790, in '
            "update_state_after_alloc\n    assert not req_status.transfer_jobs\nAssertionError\n")
    found = triage_file(write(tmp_path, text), catalogue, release="0.26.0")
    assert found.failure.kind == "crash" and found.failure.outcome == "other_crash"
    assert found.failure.pattern is None and found.unknown and found.matches == ()
    near = {m.entry: m for m in found.near_misses}
    assert "the same function (update_state_after_alloc)" in near["offload-boundary-assert"].why[0]


def test_a_runtime_traceback_is_never_did_not_start(tmp_path, catalogue):
    """No start-up line in a paste: the frames say whether the engine was serving."""
    runtime = triage_file(write(tmp_path, "\n".join(line.split("Z ", 1)[1] for line in seed_traceback()[:9]), "r.log"),
                          catalogue)
    assert (runtime.failure.kind, runtime.failure.phase) == ("crash", "runtime")
    assert "did not start" not in runtime.failure.title and runtime.unknown
    startup = triage_file(write(tmp_path, (
        "Traceback (most recent call last):\n"
        '  File "/x/vllm/v1/engine/core.py", line 90, in _initialize_kv_caches\n'
        "    available = self.model_executor.determine_available_memory()\n"
        "torch.OutOfMemoryError: CUDA out of memory.\n"), "s.log"), catalogue)
    assert (startup.failure.kind, startup.failure.phase) == ("infra", "startup")
    assert startup.failure.title.startswith("engine did not start")


def test_an_assert_cut_off_before_its_exception_and_hand_quoted_frames(tmp_path, catalogue):
    """A traceback cut off before its exception is named by its last frame's statement when that is
    a signature's; a last frame showing an assert gives AssertionError; a comment's 'file, in
    function' and its statement are enough to name the signature (vllm#49118's confirming comment)."""
    cut = "\n".join(line.split("Z ", 1)[1] for line in seed_traceback()[:-1])
    found = triage_file(write(tmp_path, "vLLM Version : 0.26.0\n--kv-offloading-size 8 --mamba-cache-mode align\n"
                              + cut, "cut.log"), catalogue)
    assert found.failure.pattern == "offload_update_state_after_alloc", found.failure
    assert found.failure.evidence.endswith("its last frame is the statement of offload_update_state_after_alloc")
    assert found.failure.title.startswith("AssertionError in update_state_after_alloc")
    assert found.best.entry == "offload-boundary-assert"
    other = cut.replace("    num_locally_computed_tokens", "    self._other_call()")
    assert triage_file(write(tmp_path, other, "other.log"), catalogue).failure.pattern is None
    asserting = triage_file(write(tmp_path, other.replace("self._other_call()", "assert x < y"), "assert.log"),
                            catalogue).failure
    assert "an assert: AssertionError" in asserting.evidence and asserting.signature.exception == "AssertionError"
    hand = triage_file(write(tmp_path, "- vLLM 0.26.0\n```\noffloading/scheduler.py, in _build_store_jobs\n"
                             "    assert len(offload_keys) == len(offload_block_ids)   # 0.26 naming\n"
                             "EngineCore encountered a fatal error.\n```\n", "hand.log"), catalogue)
    assert hand.failure.pattern == "offload_build_store_jobs"
    assert hand.best.entry == "queued-abort-store-assert"


def test_partial_evidence_must_agree_and_say_enough():
    """A hand-made signature (path, exception, the statement's lines; vllm#48959) and an exception
    line alone (vllm#55168) match a pattern only through what they give: a statement that differs
    rules it out, one piece is not enough, a message only through the pattern's own regex."""
    lines = [(1, _BODY), (2, "AssertionError:"), (3, "    num_pending_gpu_blocks"),
             (4, "    <= sliding_window_size_in_blocks * block_size_factor")]
    loose = failure_module.loose_evidence(lines)
    assert (loose.signature.file, loose.signature.exception) == (_BODY, "AssertionError")
    pattern, fits, said = failure_module.match_partial(loose.signature, loose.message)
    assert pattern.name == "offload_sliding_window_pending" and said == "file + statement"
    other = lines[:2] + [(3, "    num_pending_gpu_blocks < 0")]
    assert failure_module.match_partial(failure_module.loose_evidence(other).signature, None)[0] is None
    only = failure_module.loose_evidence([(1, "AssertionError: num_external_tokens=64512 not aligned to group 0 "
                                              "block_size=12288")])
    pattern, _, said = failure_module.match_partial(only.signature, only.message)
    assert pattern.name == "simple_offload_group_alignment" and said == "message"
    bare = failure_module.loose_evidence([(1, "AssertionError")])
    assert failure_module.match_partial(bare.signature, bare.message) == (None, (), "")


@pytest.mark.parametrize("line, version, what", [
    ("(APIServer pid=1) INFO 08-19 06:10:02 [api_server.py:1836] vLLM API server version 0.26.0", "0.26.0",
     "the API server's banner"),
    ("ERROR 11-18 07:48:24 [dump_input.py:72] Dumping input data for V1 LLM engine (v0.11.2) with config: "
     "model='m'", "0.11.2", "the engine's input dump"),
    ("vLLM Version                 : 0.27.1", "0.27.1", "collect_env output"),
    ("[pip3] vllm==0.25.1", "0.25.1", "pip freeze output"),
    ("vllm                                     0.18.1.dev35+g36ed358b1.empty", "0.18.1.dev35+g36ed358b1.empty",
     "pip list output"),
    ("docker run --gpus all vllm/vllm-openai:v0.26.0 --model m", "0.26.0", "the docker image tag"),
    ("pip install vllm-0.30.0-cp38-abi3-manylinux1_x86_64.whl", "0.30.0", "a wheel's file name"),
    ("- **vLLM**: 0.20.0", "0.20.0", "an environment line"),
    ("vllm 0.4.3", "0.4.3", "an environment line"),
    ("`vllm.__version__ == 1.5.0`", "1.5.0", "an environment line"),
])
def test_the_version_from_any_source(line, version, what):
    assert find_version(line)[0::2] == (version, what)


@pytest.mark.parametrize("line", ["/opt/conda/envs/vllm-0.19/lib/python3.12/site-packages/vllm/x.py",
                                  "vllm_ascend                              0.1.dev100+gd773192cd",
                                  "image: vllm/vllm-openai:nightly-4080263bb2c5"])
def test_not_a_version(line):
    assert find_version(line) is None


def test_pip_show_gives_the_version(tmp_path, catalogue):
    found = triage_file(write(tmp_path, "$ pip show vllm\nName: vllm\nVersion: 0.27.1\nSummary: x\n"), catalogue)
    assert (found.config.release, found.config.source("release")) == ("0.27.1", "line 3: pip show output")


def test_configuration_from_what_users_paste():
    text = """python3 -m vllm.entrypoints.openai.api_server \\
  --model /m --tensor-parallel-size 8 \\
  --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both"}'
python -m vllm.entrypoints.openai.api_server
--gpu-memory-utilization 0.85 -tp 2
--enable-prefix-caching
containers:
  - name: vllm
    args:
      - "org/model"
      - "--data-parallel-size"
      - "3"  # a comment
      - "--speculative-config"
      - '{"method": "mtp", "num_speculative_tokens": 2}'
    Command:
      vllm
      serve
    Args:
      org/other
      --no-enable-prefix-caching
llm = LLM(model="org/llm", tensor_parallel_size=tp,
          kv_transfer_config={"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
{
  "kv_connector": "NixlConnector",
  "kv_role": "kv_both"
}
Relevant flags: `--kv-offloading-size 512 --kv-offloading-backend native`
"""
    found = read_text(list(enumerate(text.splitlines(), 1)))
    got = [(f.line, f.what, f.args) for f in found]
    assert got[0] == (1, "the API server command", {"model": "/m", "tensor_parallel_size": 8, "kv_transfer_config": {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both"}})
    assert got[1] == (4, "the API server command", {"tensor_parallel_size": 2, "enable_prefix_caching": True})
    assert got[2] == (9, "the pod's args list", {"model_tag": "org/model", "data_parallel_size": 3,
                                                 "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}})
    assert got[3] == (15, "the pod's Command list (vllm serve)", {"model_tag": "org/other", "enable_prefix_caching": False})
    assert got[4][:2] == (21, "the LLM(...) call") and got[4][2] == {
        "model": "org/llm", "kv_transfer_config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}}
    assert found[3 + 1].problems == ("tensor_parallel_size is tp (not a literal: not read)",)
    assert got[5] == (23, "a JSON connector config", {"kv_transfer_config": {"kv_connector": "NixlConnector",
                                                                              "kv_role": "kv_both"}})
    assert got[6] == (27, "flags quoted in the text", {"kv_offloading_size": 512.0, "kv_offloading_backend": "native"})


def test_values_are_data_never_code():
    """A command is split by shlex and JSON parsed by json: what looks like code stays text; a
    call's non-literal argument is not read."""
    args, problems = parse_flags(split_command(
        "vllm serve m --kv-transfer-config '{\"kv_connector\": \"__import__(\\\"os\\\").system(\\\"x\\\")\"}' "
        "--speculative-config '{bad json' --tensor-parallel-size $(id)"))
    assert args["kv_transfer_config"] == {"kv_connector": '__import__("os").system("x")'}
    assert problems == ["--speculative-config: not JSON (Expecting property name enclosed in double quotes at column 2)",
                        "--tensor-parallel-size: '$(id)' is not a number"]
    found = read_text([(1, "LLM(model=__import__('os').getcwd(), enable_prefix_caching=True)")])
    assert found[0].args == {"enable_prefix_caching": True}
    assert "(not a literal: not read)" in found[0].problems[0]


def test_a_default_is_never_shown_as_read(tmp_path, catalogue):
    found = triage_file(write(tmp_path, "AssertionError: something\n"), catalogue)
    assert found.config.sources == {} and set(found.config.facets().values()) == {"unknown"}
    data = render.as_json(found)
    assert data["config"]["tensor_parallel_size"] is None and data["config"]["prefix_caching"] is None
    assert "tensor_parallel_size" in data["config"]["not_in_log"]
    assert any(line.startswith("  - not in the log: version, model") for line in render.plain(found))
    seed = triage_file(SEED, catalogue)
    assert seed.config.source("tensor_parallel_size") == "line 2: the non-default args line"
    assert seed.config.source("scheduling_policy") == "line 2: the non-default args line leaves it at vLLM's default"
    assert seed.config.source("mamba_cache_mode") == "line 5: vLLM's Mamba cache mode line"


@pytest.mark.parametrize("raw, want", [
    ("> (EngineCore pid=5) ERROR 05-27 18:56:31 core.py:1142] Traceback (most recent call last):",
     "(EngineCore pid=5) ERROR 05-27 18:56:31 [core.py:1142] Traceback (most recent call last):"),
    ("Apr  3 17:38:57 host prog[140320]: #033[1;36m(VllmWorker rank=2 pid=140320)#033[0;0m   File \"a.py\", line 1, in f",
     "(VllmWorker_rank2 pid=140320)   File \"a.py\", line 1, in f"),
    ("[2026-04-14T06:24:27Z] (EngineCore pid=5105) ERROR 2026-04-14 06:24:28.876 [core.py:1110] x",
     "(EngineCore pid=5105) ERROR 04-14 06:24:28.876 [core.py:1110] x"),
    ("   (EngineCore pid=1) ERROR 06-16 07:42:55 [core.py:1138]   File \".../vllm/a.py\", in schedule",
     "(EngineCore pid=1) ERROR 06-16 07:42:55 [core.py:1138]   File \".../vllm/a.py\", line 0, in schedule"),
    ("[rank0]:   File \"/x/vllm/a.py\", line 3, in f", "  File \"/x/vllm/a.py\", line 3, in f"),
    ("s]Processed 1(EngineCore_DP0 pid=9) ERROR 02-12 15:54:28 [core.py:1008] EngineCore encountered a fatal error.",
     "(EngineCore_DP0 pid=9) ERROR 02-12 15:54:28 [core.py:1008] EngineCore encountered a fatal error."),
])
def test_one_line_made_readable(raw, want):
    assert normalise(raw) == want


def test_a_paste_is_mended_from_its_neighbours():
    """Fences dropped and their block dedented; a traceback opened where frames start without its
    first line; a source line that lost its indentation indented again; the logger header of the
    traceback's first lines given to those without it."""
    text = ["  ```", '  File "/x/vllm/a.py", line 3, in f', "  y = g()", "  ValueError: bad", "  ```",
            "(E pid=1) ERROR 01-01 00:00:00 [core.py:1] Traceback (most recent call last):",
            '(E pid=1)   File "/x/vllm/b.py", line 4, in h', "(E pid=1)     z()", "(E pid=1) KeyError: 'r'"]
    out = repair(enumerate(text, 1))
    assert out == [(1, None), (2, "Traceback (most recent call last):"), (2, 'File "/x/vllm/a.py", line 3, in f'),
                   (3, "    y = g()"), (4, "ValueError: bad"), (5, None),
                   (6, "(E pid=1) ERROR 01-01 00:00:00 [core.py:1] Traceback (most recent call last):"),
                   (7, '(E pid=1) ERROR 01-01 00:00:00 [core.py:1]   File "/x/vllm/b.py", line 4, in h'),
                   (8, "(E pid=1) ERROR 01-01 00:00:00 [core.py:1]     z()"),
                   (9, "(E pid=1) ERROR 01-01 00:00:00 [core.py:1] KeyError: 'r'")]
    # a line the process logged as another record is never taken into the traceback
    other = ['(E pid=1)   File "/x/vllm/b.py", line 4, in h', "(E pid=1) INFO 01-01 00:00:01 [x.py:2] unrelated"]
    assert repair(enumerate(other, 1))[-1] == (2, "(E pid=1) INFO 01-01 00:00:01 [x.py:2] unrelated")


def test_text_is_never_refused_and_release_is_never_blocked(tmp_path, catalogue):
    """Not vLLM's, no version, a release far from the supported ones, the exception line alone:
    exit 0, said plainly; --release sets the base for a text that gives none."""
    nginx = write(tmp_path, '10.0.0.1 - - [19/Aug/2026:06:10:02 +0000] "GET / HTTP/1.1" 200 612\n', "nginx.log")
    found = triage_file(nginx, catalogue, release="0.26.0")
    assert found.failure.kind == "none" and found.base == "0.26.0" and found.config.source("release") == "--release"
    assert any("nothing in this text is vLLM's" in w for w in found.warnings)
    old = triage_file(write(tmp_path, "vllm==0.6.4\nAssertionError\n", "old.log"), catalogue)
    assert old.base is None and old.failure.kind == "crash" and old.unknown
    utf16 = tmp_path / "notepad.log"  # a report saved by an editor as UTF-16: text, with NUL bytes
    utf16.write_bytes("vllm==0.26.0\r\nRuntimeError: CUDA error: an illegal memory access\r\n".encode("utf-16"))
    found = triage_file(utf16, catalogue)
    assert (found.config.release, found.failure.kind) == ("0.26.0", "crash")
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "triage", str(write(tmp_path, "AssertionError\n")),
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["unknown"] is True and data["failure"]["kind"] == "crash" and data["best"] is None


@pytest.mark.parametrize("text, title", [
    ("(EngineCore_DP0 pid=3) Fatal Python error: Segmentation fault\n(EngineCore_DP0 pid=3) Thread 0x7f (most recent "
     "call first):\n(EngineCore_DP0 pid=3)   File \"/x/vllm/v1/worker/gpu_model_runner.py\", line 2311 in execute_model\n",
     "Fatal Python error in gpu_model_runner.py: Segmentation fault"),
    ("terminate called after throwing an instance of 'c10::Error'\n  what():  CUDA error: an illegal memory access "
     "was encountered\n", "c10::Error: CUDA error: an illegal memory access was encountered"),
])
def test_a_process_that_died_in_native_code(text, title, tmp_path, catalogue):
    """faulthandler's dump (not a traceback: most recent call first) and an uncaught C++ exception:
    a crash said by its own line, unknown to the catalogue."""
    found = triage_file(write(tmp_path, text), catalogue)
    assert (found.failure.kind, found.failure.title) == ("crash", title) and found.unknown


def test_a_report_compressed_or_piped_is_read_whole_as_a_paste(tmp_path, catalogue):
    """The one opener (kvrepro/classify/logfile.py, issue 44) hands triage the text of an xz file
    or a pipe; a small text is then read whole as a paste (issue 45), not through the production
    log's keyword greps, which would miss a version said only by `pip list`'s line."""
    import lzma

    text = "```\nvllm                 0.26.0\n```\nRuntimeError: CUDA error: an illegal memory access\n"
    packed = tmp_path / "report.log.xz"
    packed.write_bytes(lzma.compress(text.encode()))
    plain = triage_file(write(tmp_path, text), catalogue)
    found = triage_file(packed, catalogue)
    assert (found.config.release, found.failure.kind, found.lines) == ("0.26.0", "crash", 4)
    assert (found.config.sources, found.failure.title) == (plain.config.sources, plain.failure.title)
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "triage", "-", "--json"], input=text, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["config"]["release"], data["failure"]["kind"]) == ("0.26.0", "crash")
