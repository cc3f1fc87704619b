"""kvrepro triage: production logs composed from public upstream reports (tests/data/triage/README.md
cites each) -> the deployed configuration, the failure, the catalogue entry, its fix and backport.

Real files throughout (plain, gzip, a binary file); the CLI runs as a subprocess. The end-to-end
test runs the emitted matrix on the GPU-free engine (real vLLM 0.26.0 scheduler and connector;
no GPU, so the model executor and the offload data movement are the engine's fakes).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, require
from kvrepro.suite.run import load as load_catalogue
from kvrepro.triage import reader, triage_file
from kvrepro.triage.deployed import parse_repr

pytestmark = pytest.mark.shares_zygotes  # one engine zygote per runtime for the session (conftest.shares_zygotes)

DATA = ROOT / "tests" / "data" / "triage"
SEED = DATA / "seed-0.26-dp4-offload-mtp.log"
SECRETS = ("sk-prod-8f2c1d9e7a6b5c4d3e2f1a0b", "hf_QmXv7pLs9Kd2Rt4Yw8Nz3Bc6Fg1Hj5Mk0")


def kvrepro(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrepro.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def catalogue():
    return load_catalogue()


# log -> (best entry, first fixing release, a backport stack on the log's base, base)
CASES = {
    "seed-0.26-dp4-offload-mtp.log": ("offload-boundary-assert", "0.27.0", ("pr-48425",), "0.26.0"),
    "all-mode-0.25.1.log": ("offload-boundary-assert-all-mode", "0.27.0", None, "0.25.1"),
    "cross-group-0.22.0.log": ("cross-group-eviction-assert", "0.25.1", None, "0.25.1"),
    "truncate-0.27.0.log": ("truncate-lagging-mamba", "0.28.0", None, "0.27.0"),
    "stall-skipped-waiting-0.28.0.log": ("skipped-waiting-deadlock", "0.31.0", None, "0.28.0"),
    "build-store-jobs-0.26.0.log": ("queued-abort-store-assert", "0.27.0", ("pr-49146",), "0.26.0"),
    "apply-cow-0.26.0.log": ("apply-cow-mamba-deeper", "0.27.0", ("pr-48425",), "0.26.0"),
    "boundary-fix-0.26.0.log": ("boundary-fix-unaligned-hit", "0.30.0", None, "0.26.0"),
    # the catalogue grown from the tracker (issue 45 item 5): one composed log per member
    "mamba-external-kv-0.22.1.log": ("mamba-align-external-hit-assert", "0.25.1", None, "0.25.1"),
    "sliding-window-0.25.1.log": ("sliding-window-unaligned-load-assert", "0.27.0", None, "0.25.1"),
    "simple-offload-dcp-0.29.0.log": ("simple-offload-dcp-hybrid-assert", "0.30.0", None, "0.29.0"),
    "tiering-final-store-0.26.0.log": ("tiering-final-store-keyerror", "0.27.0", ("pr-49671",), "0.26.0"),
    "tiering-mtp-store-0.26.0.log": ("tiering-mtp-store-assert", "0.27.0", None, "0.26.0"),
    "no-connector-stall-0.22.1.log": ("no-connector-waiting-stall", None, None, "0.25.1"),
    "chunked-local-startup-0.26.0.log": ("chunked-local-offload-startup-assert", "0.28.0", None, "0.26.0"),
    "multiconnector-store-0.26.0.log": ("multiconnector-keys-lag-store-assert", "0.30.0", None, "0.26.0"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_names_the_right_entry_first_with_its_fix(name, catalogue):
    best, fixed, backport, base = CASES[name]
    found = triage_file(DATA / name, catalogue)
    assert found.best is not None and found.best.entry == best, [m.entry for m in found.matches]
    if fixed is None:  # no merged upstream fix
        assert found.best.fixed_in_releases == ()
    else:
        assert found.best.fixed_in_releases[0] == fixed
    if backport is not None:
        assert backport in found.best.backports
    assert found.base == base
    assert not found.unknown


def test_every_catalogue_crash_entry_has_a_log():
    """A new crash entry in defects/ needs its log here (composed from its upstream report)."""
    crash_entries = {e.name for e in load_catalogue().entries if e.kind == "crash"}
    assert crash_entries <= {best for best, *_ in CASES.values()}
    readme = (DATA / "README.md").read_text()
    for name in CASES:
        assert name in readme, f"{name} is not cited in tests/data/triage/README.md"


def test_near_misses_say_why_not(catalogue):
    found = triage_file(DATA / "seed-0.26-dp4-offload-mtp.log", catalogue)
    misses = {m.entry: m.why_not for m in found.near_misses}
    assert misses["offload-boundary-assert-all-mode"] == ("needs mamba_cache_mode all, the log has align",)
    assert any("fixed from 0.25.1" in w for w in misses["cross-group-eviction-assert"])
    stall = triage_file(DATA / "stall-skipped-waiting-0.28.0.log", catalogue)
    assert stall.failure.kind == "stall" and stall.failure.stall.deferred == 3
    assert stall.failure.stall.seconds == 360
    assert {m.entry: m.why_not for m in stall.near_misses}["mtp-async-load-deadlock"] == (
        "needs speculative mtp/eagle/eagle3, the log has none",)


def test_the_seed_configuration_is_read_whole(catalogue):
    """DP-prefixed, container timestamps, ANSI colour, enum reprs in the args dict."""
    c = triage_file(SEED, catalogue).config
    assert (c.release, c.model, c.architecture) == ("0.26.0", "Qwen/Qwen3.5-397B-A17B-FP8",
                                                    "Qwen3_5MoeForConditionalGeneration")
    assert (c.data_parallel_size, c.tensor_parallel_size, c.engines_seen) == (4, 4, 4)
    assert (c.mamba_cache_mode, c.block_size, c.prefix_caching) == ("align", 2128, True)
    assert c.kv_connector == "OffloadingConnector"
    assert c.kv_connector_settings == {"kv_offloading_size": 384.0, "kv_offloading_backend": "native"}
    assert (c.speculative_method, c.num_speculative_tokens) == ("mtp", 1)
    assert c.args["hf_token"] == "***" and c.args["api_key"] == ["***"]


def test_kv_transfer_config_is_read_without_evaluating_anything(catalogue):
    c = triage_file(DATA / "truncate-0.27.0.log", catalogue).config
    assert c.kv_connector == "OffloadingConnector" and c.offload_chunk_tokens == 1088 and c.block_size == 544
    # a call is read as its text and arguments, never run
    assert parse_repr("{'a': __import__('os').system('exit 3')}") == {
        "a": {"__class__": "__import__('os').system", "_0": "exit 3"}}
    value = parse_repr("{'x': KVTransferConfig(kv_connector='Nixl', kv_connector_extra_config={'k': [1, -2]}), "
                       "'m': <CompilationMode.NONE: 0>}")
    assert value == {"x": {"__class__": "KVTransferConfig", "kv_connector": "Nixl",
                           "kv_connector_extra_config": {"k": [1, -2]}}, "m": "<CompilationMode.NONE: 0>"}
    with pytest.raises(ValueError):
        parse_repr("{'model': 'cut off here")


def test_an_unknown_crash_is_said_to_be_unknown(catalogue):
    """#52807's alignment assertion on 0.30.0: its one entry (boundary-fix-unaligned-hit, a 0.26.0 stack
    without #49502) says 0.30.0 is fixed, so the crash is unknown there, with that entry as the near
    miss that says why, and not forced onto the entries of the same function (update_state_after_alloc's
    boundary assertion)."""
    found = triage_file(DATA / "unknown-alignment-0.30.0.log", catalogue)
    assert found.failure.kind == "crash" and found.failure.pattern == "offload_boundary_alignment"
    assert found.base == "0.30.0"
    assert found.unknown and found.matches == ()
    assert {m.entry: m.why_not for m in found.near_misses} == {
        "boundary-fix-unaligned-hit": ("fixed from 0.30.0 on, and 0.30.0 is that or later",)}
    proc = kvrepro("triage", str(DATA / "unknown-alignment-0.30.0.log"))
    assert proc.returncode == 0 and "unknown: no catalogue entry fits" in proc.stdout
    assert "no entry with its crash signature offload_boundary_alignment claims" in " ".join(proc.stdout.split())
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80


def test_json_lists_matches_best_first_without_secrets():
    proc = kvrepro("triage", str(SEED), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["best"] == "offload-boundary-assert" and data["unknown"] is False
    assert [m["entry"] for m in data["matches"]][0] == "offload-boundary-assert"
    assert "https://github.com/vllm-project/vllm/pull/52807" in data["matches"][0]["upstream"]
    # #49118 (queued aborts) and #49635 (multi-tier final store) are on 0.26.0 too
    assert data["minimal_clean_set"] == ["pr-48425", "pr-49146", "pr-49671"]
    assert not any(s in proc.stdout for s in SECRETS)
    plain = kvrepro("triage", str(SEED))
    assert max(len(line) for line in plain.stdout.splitlines()) <= 80, plain.stdout


def test_emit_writes_a_matrix_that_validates(tmp_path):
    out = tmp_path / "repro"
    proc = kvrepro("triage", str(SEED), "--emit", str(out))
    assert proc.returncode == 0, proc.stderr
    text = (out / "matrix.yaml").read_text()
    assert not any(s in text for s in SECRETS)
    data = yaml.safe_load(text)
    assert data["base"] == "0.26.0" and data["common"] == []
    assert data["builds"] == {"as-deployed": [], "upstream-fix": ["pr-52807"], "minimal-clean-set": ["pr-48425", "pr-49146", "pr-49671"]}
    assert data["engine"]["geometry"] == {"block_size": 2128, "offload_chunk_tokens": 2128, "mamba_groups": 3,
                                          "full_attention_groups": 1, "num_speculative_tokens": 1,
                                          "data_parallel_size": 4}
    assert data["expect"] == {"as-deployed": "CRASH(target)", "upstream-fix": "CORRUPT",
                              "minimal-clean-set": "SURVIVED|UNREACHED"}
    assert sorted(p.name for p in (out / "builds").iterdir()) == ["pr-48425.patch", "pr-49146.patch", "pr-49671.patch",
                                                                  "pr-52807.patch"]
    valid = kvrepro("matrix", "validate", "-m", str(out / "matrix.yaml"), "--json")
    assert valid.returncode == 0, valid.stderr
    assert json.loads(valid.stdout)["builds"] == ["as-deployed", "upstream-fix", "minimal-clean-set"]
    again = kvrepro("triage", str(SEED), "--emit", str(out))
    assert again.returncode == 2 and "already holds a matrix.yaml" in again.stderr


def test_gzip_and_a_large_interleaved_log_read_the_same(tmp_path, catalogue, monkeypatch):
    """The seed log buried in access and stats lines of other engines, gzipped, read in small blocks
    (so the traceback and its window cross block boundaries): same answer, right line number."""
    lines = SEED.read_text().splitlines(keepends=True)
    filler = [f'2026-08-19T07:00:00.000000Z (APIServer pid=1) INFO:     10.0.7.{i % 250}:4{i % 9999:04d} - '
              f'"POST /v1/chat/completions HTTP/1.1" 200 OK\n' for i in range(30_000)]
    big = lines[:18] + filler + lines[18:]
    path = tmp_path / "big.log.gz"
    with gzip.open(path, "wt") as fh:
        fh.writelines(big)
    monkeypatch.setattr(reader, "BLOCK", 4096)
    found = triage_file(path, catalogue)
    assert found.best.entry == "offload-boundary-assert"
    assert found.lines == len(big)
    assert found.failure.line == 30_000 + 20  # the seed log's line 20 ("Traceback ..." of EngineCore_DP2)


@pytest.mark.parametrize("name, says", [
    ("binary", "not a text log (binary data"),
    ("truncated.gz", "damaged gzip data"),
    ("empty", "is empty"),
])
def test_what_is_not_text_is_one_line_and_exit_2(name, says, tmp_path):
    if name == "binary":
        path = tmp_path / "core.dump"
        path.write_bytes(bytes(range(256)) * 64)
    elif name == "truncated.gz":
        path = tmp_path / "cut.log.gz"
        path.write_bytes(gzip.compress(SEED.read_bytes())[:600])
    else:
        path = tmp_path / "empty.log"
        path.write_bytes(b"")
    proc = kvrepro("triage", str(path))
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 or proc.stderr.count("error:") == 1


@pytest.mark.parametrize("name, says, best", [
    ("not-vllm.log", "nothing in this text is vLLM's", None),
    ("unsupported-0.19.0.log", "vLLM 0.19.0 is not near the releases kvrepro runs", None),
    # its last frame is the target's own statement: named by it, the cut said
    ("truncated-traceback-0.26.0.log", "cut off before its exception line", "offload-boundary-assert"),
])
def test_text_kvrepro_cannot_read_whole_is_triaged_not_refused(name, says, best, catalogue):
    """Issue 45: only what is not text is refused. A text that is not vLLM's, a release far from
    the supported ones, a traceback cut off before its exception: exit 0, said plainly."""
    proc = kvrepro("triage", str(DATA / name))
    assert proc.returncode == 0, proc.stderr
    assert says in " ".join(proc.stdout.split()), proc.stdout
    found = triage_file(DATA / name, catalogue)
    assert (found.best.entry if found.best else None) == best


def test_emit_needs_a_release_kvrepro_runs(tmp_path):
    proc = kvrepro("triage", str(DATA / "unsupported-0.19.0.log"), "--emit", str(tmp_path / "out"))
    found = proc.stdout
    if "matches, best first" in found:
        assert proc.returncode == 2 and "--release X.Y.Z" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 1 and "nothing to reproduce" in proc.stderr


def test_run_reproduces_the_seed_crash_and_the_clean_set_is_clean(tmp_path, runtime_python):
    """The seed's production configuration as a log, reproduced in one command: `as-deployed` dies on
    the target assertion, the minimal clean set (pr-48425 + pr-49146 + pr-49671 on 0.26.0) serves its requests clean.
    One repetition per build (the emitted matrix's runs.repetitions)."""
    require(runtime_python.exists(), "the vLLM runtime env")
    out = tmp_path / "repro"
    proc = kvrepro("triage", str(SEED), "--emit", str(out), "--run", "--json", "--results", str(tmp_path / "r"),
                   timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["best"] == "offload-boundary-assert"
    proofs = {p["build"]: p for p in data["proofs"]}
    assert proofs["as-deployed"]["verdicts"] == ["CRASH(target)"]
    assert proofs["minimal-clean-set"]["verdicts"][0] in ("UNREACHED", "SURVIVED")
    assert all(p["as_expected"] for p in proofs.values()), proofs


def test_grep_and_the_python_reader_select_the_same_lines(tmp_path, monkeypatch):
    """Plain files through one grep pass and windows read at grep's offsets, gzip through three greps
    fed the decompressed stream, and the Python block reader: the same lines, numbers and counts
    (small blocks, so windows cross block boundaries)."""
    lines = SEED.read_text().splitlines(keepends=True)
    filler = [f"(APIServer pid=1) INFO:     10.0.0.{i % 250}:4000 - \"GET /health HTTP/1.1\" 200 OK\n"
              for i in range(5000)]
    path = tmp_path / "mixed.log"
    path.write_text("".join(lines[:25] + filler + lines[25:]) + "no newline at the end")
    monkeypatch.setattr(reader, "BLOCK", 1024)
    require(reader._gnu_grep() is not None, "GNU grep")
    by_grep, by_python = reader.ReadStats(), reader.ReadStats()
    grep_lines = list(reader.read_selected(path, by_grep))
    python_lines = list(reader.read_selected(path, by_python, use_grep=False))
    assert grep_lines == python_lines
    assert (by_grep.lines, by_grep.last_line, by_grep.bytes_read) == (by_python.lines, by_python.last_line,
                                                                      by_python.bytes_read)
    assert by_grep.lines == len(lines) + 5000 + 1
    gz = tmp_path / "mixed.log.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    by_gz = reader.ReadStats()
    assert list(reader.read_selected(gz, by_gz)) == python_lines
    assert (by_gz.lines, by_gz.last_line) == (by_python.lines, by_python.last_line)
