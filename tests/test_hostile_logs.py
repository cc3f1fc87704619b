"""Issue 44, hardening round four: a log is data, never a program. A hostile corpus of our own:
crafted production logs (newline, YAML, quote and control-character injection in every value
triage reads; values out of matrix.yaml's bounds; code-loading options), folders full of links
for `triage --emit` and `kvrepro init`, bombs, FIFOs, huge numbers and secrets in every spelling.

Each case checks the promise of docs/reliability.md ("Trust boundary"): no file outside the
target folder, no code from the input runs, one line and a documented exit code. Real parts
throughout: real files, links, FIFOs (os.mkfifo), gzip/bz2/xz streams, the `kvrepro` command as
a process where the exit code and the one line matter; in-process calls (triage_file,
build_matrix, write_matrix) where only the data matters, to keep the corpus cheap. Memory is
measured by benchmarks/hostile_logs.py, never asserted as a time here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, require
from test_hostile_inputs import kvrepro as _kvrepro
from test_hostile_inputs import one_line as _one_line
from kvrepro.errors import BadInputError
from kvrepro.suite.run import load as load_catalogue
from kvrepro.triage import triage_file
from kvrepro.triage.emit import build_matrix, write_matrix
from kvrepro.triage.commands import target_of
from kvrepro.untrusted import LinkInTheWay, WriteFolder, quote

DATA = ROOT / "tests" / "data" / "triage"
SEED = DATA / "seed-0.26-dp4-offload-mtp.log"
HANG = 120


def kvrepro(*args: str, timeout: float = HANG) -> subprocess.CompletedProcess:
    return _kvrepro(*args, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """test_hostile_inputs.one_line (exit ``code``, one line, no traceback, ``words``), and short."""
    line = _one_line(proc, code, *words)
    assert len(line) < 600, line[:600]
    return line


@pytest.fixture(scope="module")
def catalogue():
    return load_catalogue()


# the seed log's args, as a dict: hostile logs are this with values replaced, printed by repr() as
# vLLM prints its non-default args (so a newline in a value is the two characters \n in the log,
# which the args reader turns back into a newline: the injection the hole took)
SEED_ARGS = {
    "model_tag": "Qwen/Qwen3.5-397B-A17B-FP8", "host": "0.0.0.0", "model": "Qwen/Qwen3.5-397B-A17B-FP8",
    "max_model_len": 262144, "enable_prefix_caching": True, "mamba_cache_mode": "align",
    "tensor_parallel_size": 4, "data_parallel_size": 4, "kv_offloading_size": 384.0,
    "kv_offloading_backend": "native", "speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
}


def seed_log(path: Path, args: dict | None = None, *, replace: dict[str, str] | None = None,
             args_text: str | None = None) -> Path:
    """The seed log with its args line's dict replaced (``args``, or ``args_text`` verbatim) and
    any other text replaced (``replace``: old -> new)."""
    lines = SEED.read_text().splitlines(keepends=True)
    head, _, _ = lines[1].partition("non-default args: ")
    lines[1] = head + "non-default args: " + (args_text if args_text is not None else repr(args or SEED_ARGS)) + "\n"
    text = "".join(lines)
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)
    return path


# values that would be YAML, a comment's end, a document marker or a terminal escape if written raw
INJECTIONS = [
    "x\npatches:\n  evil: {file: /tmp/evil.patch, outside_matrix_folder: true}\nbuilds:\n  as-deployed: [evil]\n#",
    "x\rbuilds: {as-deployed: [evil]}",
    "x\x85builds: {as-deployed: [evil]}",
    "x\u2028builds: {as-deployed: [evil]}\u2029engine: {extra_args: [--worker-extension-cls, evil.W]}",
    "x'\"# \n---\nbase: 0.30.0\n...\n%YAML 1.1\n!!python/object/apply:os.system [touch /tmp/pwned]",
    "&a [*a, *a]\n\x1b[2J\x1b]0;title\x07",
    "m" * 5000,
]


def _emit(tmp_path: Path, log: Path, catalogue) -> tuple[Path, dict]:
    found = triage_file(log, catalogue)
    # a value no entry's requirements fit (a Mamba cache mode 'align\nbuilds: ...') matches nothing,
    # and triage stops there; the seed's entry stands in to check what emitting it would do
    entry = next(e for e in catalogue.entries if e.name == (found.best.entry if found.best else
                                                            "offload-boundary-assert"))
    data, notes = build_matrix(found, entry, list(catalogue.entries), target_of(found))
    out = tmp_path / "emit"
    path = write_matrix(out, data, found, entry, notes)
    return path, data


def _assert_only_data(path: Path, meant: dict) -> None:
    """matrix.yaml is the data meant, shipped patches only, and a header of one-line comments."""
    text = path.read_text()
    assert yaml.safe_load(text) == meant
    header = text.split("\n\n", 1)[0].splitlines()
    assert header and all(line.startswith("# ") for line in header), header
    assert not any(c in text for c in "\r\x85\u2028\u2029\x1b\x07")
    shipped = yaml.safe_load((ROOT / "matrix.yaml").read_text())["patches"]
    assert all(shipped[name] == spec for name, spec in meant["patches"].items())
    assert {p.name for p in (path.parent / "builds").iterdir()} == {s["file"] for s in meant["patches"].values()}
    assert "extra_args" not in meant["engine"] or meant["engine"]["extra_args"] == []
    assert set(meant) == {"base", "target", "patches", "common", "builds", "target_signature", "engine", "load",
                          "runs", "expect"}


@pytest.mark.parametrize("field", ["model_tag", "model", "kv_connector", "speculative_method"])
@pytest.mark.parametrize("value", INJECTIONS, ids=range(len(INJECTIONS)))
def test_no_log_value_becomes_yaml(tmp_path, catalogue, field, value):
    """The hole (issue 44): a value read from the args line with newlines and YAML in it. The
    emitted matrix holds exactly what triage meant; the value shows on one quoted comment line."""
    args = dict(SEED_ARGS)
    if field == "kv_connector":  # still an offloading connector by its name, so that the entry matches
        value = "OffloadingConnector" + value
        args["kv_transfer_config"] = {"kv_connector": value, "kv_role": "kv_both"}
        args.pop("kv_offloading_size")
    elif field == "speculative_method":
        value = "mtp" + value
        args["speculative_config"] = {"method": value, "num_speculative_tokens": 1}
    else:
        args[field] = value
    path, data = _emit(tmp_path, seed_log(tmp_path / "evil.log", args), catalogue)
    _assert_only_data(path, data)
    header = path.read_text().split("\n\n", 1)[0]
    assert quote(value) in header or field == "model" and args["model_tag"] != value  # model_tag wins


def test_a_log_file_name_and_a_banner_are_one_line_too(tmp_path, catalogue):
    name = "prod\nbuilds: {as-deployed: [evil]}\n#.log"
    log = seed_log(tmp_path / name, replace={"vLLM API server version 0.26.0": "vLLM API server version 0.26.0'\"#:{"})
    path, data = _emit(tmp_path, log, catalogue)
    _assert_only_data(path, data)


@pytest.mark.parametrize("where, value, field, line", [
    ("block_size", 1 << 40, "block_size", 6),  # the attention block info line wins over the args
    ("args:block_size", -16, "block_size", 2),
    ("chunk", 1e308, "offload_chunk_tokens", 2),
    ("mtp", 1_000_000, "num_speculative_tokens", 2),
    ("dp", -3, "data_parallel_size", 2),
    ("mamba", "align\nbuilds: {}", "mamba_cache_mode", 2),
])
def test_log_values_out_of_the_matrix_bounds_name_the_line(tmp_path, catalogue, where, value, field, line):
    """The same bounds matrix.yaml has (engine.geometry, engine), with the log's line: nothing written."""
    args = dict(SEED_ARGS)
    replace = {}
    if where == "block_size":
        replace = {"Setting attention block size to 2128 tokens": f"Setting attention block size to {value} tokens"}
    elif where == "args:block_size":
        args["block_size"] = value
        replace = {"Setting attention block size to 2128 tokens": "Setting attention block size tokens"}
    elif where == "chunk":
        args["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config":
                                      {"block_size": value}}
    elif where == "mtp":
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": value}
    elif where == "dp":
        args["data_parallel_size"] = value
    elif where == "mamba":
        args["mamba_cache_mode"] = value
        replace = {"Mamba cache mode is set to 'align'": "Mamba cache mode is set",
                   "Prefix caching in Mamba cache 'align' mode": "Prefix caching in Mamba cache mode"}
    log = seed_log(tmp_path / "bounds.log", args, replace=replace)
    with pytest.raises(BadInputError) as exc:
        _emit(tmp_path, log, catalogue)
    message = str(exc.value)
    assert message.startswith(f"{log}:{line}: {field} "), message
    assert "\n" not in message and len(message) < 400, message
    assert not (tmp_path / "emit" / "matrix.yaml").exists()


def test_code_loading_options_in_the_log_never_reach_the_engine(tmp_path, catalogue):
    """worker_extension_cls, kv_connector_module_path, a chat template, trust_remote_code: read as
    data for the triage, never in the emitted matrix (which takes only geometry from the log)."""
    args = {**SEED_ARGS, "worker_extension_cls": "evil.Ext", "chat_template": "/tmp/evil.jinja",
            "trust_remote_code": True, "logits_processors": ["evil.LP"],
            "kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_connector_module_path": "evil.conn",
                                   "kv_role": "kv_both"}}
    path, data = _emit(tmp_path, seed_log(tmp_path / "code.log", args), catalogue)
    _assert_only_data(path, data)
    text = path.read_text()
    assert "evil" not in text


def test_a_catalogue_fragment_cannot_smuggle_code_or_patches_either(tmp_path, catalogue):
    """Belt and braces behind the catalogue's own checks: whatever built the data, write_matrix
    refuses a patch that is not the shipped one and an engine option that loads code."""
    found = triage_file(SEED, catalogue)
    entry = next(e for e in catalogue.entries if e.name == found.best.entry)
    data, notes = build_matrix(found, entry, list(catalogue.entries), target_of(found))
    bad_patch = {**data, "patches": {**data["patches"], "pr-48425": {"file": "../../x.patch", "upstream": "x",
                                                                     "outside_matrix_folder": True}}}
    bad_args = {**data, "engine": {**data["engine"], "extra_args": ["--worker_extension_cls=evil.W"]}}
    module = {**data, "engine": {**data["engine"], "extra_args": [
        "--kv-transfer-config", '{"kv_connector_module_path": "evil", "kv_connector_extra_config": {}}']}}
    spec_module = {**data, "engine": {**data["engine"], "extra_args": [
        '--kv-transfer-config={"kv_connector_extra_config": {"spec_module_path": "evil.spec"}}']}}
    bad_model = {**data, "engine": {**data["engine"], "model": "/tmp/evil-model"}}
    for bad, words in ((bad_patch, "not one of the shipped"), (bad_args, "loads code"),
                       (module, "names code to load .*kv_connector_module_path"),
                       (spec_module, "names code to load .*spec_module_path"), (bad_model, "not a model")):
        with pytest.raises(BadInputError, match=words):
            write_matrix(tmp_path / "x", bad, found, entry, notes)
        assert not (tmp_path / "x" / "matrix.yaml").exists()
    # the catalogue's multi-tier entries name vLLM's own spec by name: that is data, and emitted
    tiering = {**data, "engine": {**data["engine"], "extra_args": [
        "--kv-transfer-config", '{"kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec"}}']}}
    assert write_matrix(tmp_path / "t", tiering, found, entry, notes).is_file()


# ------------------------------------------------------------------ links around the target folder

def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    return outside


def _seed_matrix(catalogue):
    found = triage_file(SEED, catalogue)
    entry = next(e for e in catalogue.entries if e.name == found.best.entry)
    data, notes = build_matrix(found, entry, list(catalogue.entries), target_of(found))
    return found, entry, data, notes


def test_emit_never_writes_through_a_link(tmp_path, catalogue):
    """--emit DIR with a dangling DIR/builds/*.patch link, DIR/builds a link, DIR a link: nothing
    outside DIR; the first is replaced inside DIR, the others refused (exit 2: LinkInTheWay is
    bad input, one line through kvrepro's error handling, as the first case shows end to end)."""
    outside = _outside(tmp_path)
    dangling = tmp_path / "dangling"
    (dangling / "builds").mkdir(parents=True)
    (dangling / "builds" / "pr-48425.patch").symlink_to(outside / "pwned")
    proc = kvrepro("triage", str(SEED), "--emit", str(dangling))
    assert proc.returncode == 0, proc.stderr
    assert not (dangling / "builds" / "pr-48425.patch").is_symlink()
    assert (dangling / "builds" / "pr-48425.patch").read_bytes() == (ROOT / "builds" / "pr-48425.patch").read_bytes()
    found, entry, data, notes = _seed_matrix(catalogue)
    linked_sub = tmp_path / "linked-sub"
    linked_sub.mkdir()
    (linked_sub / "builds").symlink_to(outside)
    with pytest.raises(LinkInTheWay, match=r"^--emit .*linked-sub/builds: a symbolic link"):
        write_matrix(linked_sub, data, found, entry, notes)
    linked = tmp_path / "linked"
    linked.symlink_to(outside)
    with pytest.raises(LinkInTheWay, match=r"^--emit .*linked: a symbolic link \(to .*outside\).*the folder itself"):
        write_matrix(linked, data, found, entry, notes)
    dangling_matrix = tmp_path / "dm"
    dangling_matrix.mkdir()
    (dangling_matrix / "matrix.yaml").symlink_to(outside / "matrix.yaml")
    with pytest.raises(BadInputError, match="already holds a matrix.yaml"):
        write_matrix(dangling_matrix, data, found, entry, notes)
    assert list(outside.iterdir()) == [] and LinkInTheWay.exit_code == 2


def test_emit_into_a_place_that_cannot_be_written_says_emit():
    line = one_line(kvrepro("triage", str(SEED), "--emit", "/sys/kernel/kvrepro-test"), 3, "--emit /sys/kernel/")
    assert "--results" not in line and "give --emit a folder you can write" in line, line


def test_init_never_writes_through_a_link(tmp_path):
    """`kvrepro init DIR`: dangling links where its files go are "already there" (and replaced
    inside DIR with --force), a linked builds/ or DIR a link to elsewhere is refused."""
    outside = _outside(tmp_path)
    project = tmp_path / "p"
    (project / "builds").mkdir(parents=True)
    (project / "matrix.yaml").symlink_to(outside / "matrix.yaml")
    (project / "builds" / "pr-52807.patch").symlink_to(outside / "x.patch")
    one_line(kvrepro("init", str(project)), 2, "already exists", "--force")
    assert kvrepro("init", str(project), "--force").returncode == 0
    assert not (project / "matrix.yaml").is_symlink() and (project / "matrix.yaml").stat().st_size > 0
    linked = tmp_path / "etc"
    linked.symlink_to(outside)
    one_line(kvrepro("init", str(linked)), 2, "a symbolic link", "give the folder itself")
    sub = tmp_path / "q"
    sub.mkdir()
    (sub / "builds").symlink_to(outside)
    one_line(kvrepro("init", str(sub)), 2, "q/builds: a symbolic link")
    assert list(outside.iterdir()) == []


def test_write_folder_refuses_every_way_out(tmp_path):
    outside = _outside(tmp_path)
    folder = tmp_path / "f"
    with WriteFolder(folder) as out:
        out.write("a/b/c.txt", "x")
        (folder / "a" / "link").symlink_to(outside)
        with pytest.raises(LinkInTheWay):
            out.write("a/link/c.txt", "x")
        (folder / "d").symlink_to(outside / "d")
        with pytest.raises(FileExistsError):
            out.write("d", "x")
        assert out.exists("d") and not out.exists("zz/y")
        with pytest.raises(LinkInTheWay):
            out.exists("a/link/nothing")
        out.write("d", "y", replace=True)
        with pytest.raises(BadInputError):
            out.write("../escape", "x")
    assert (folder / "d").read_text() == "y" and not (folder / "d").is_symlink()
    assert list(outside.iterdir()) == []


def test_quote_is_one_bounded_line():
    assert quote("a\nb\r\u2028\x1b[0m") == "a\\nb\\r\\u2028\\x1b[0m"
    assert quote("v" * 1000).endswith("... (1,000 characters)") and len(quote("v" * 1000)) < 110
    assert quote(10 ** 5000).startswith("a number of about 5,0")
    assert quote(-16) == "-16"


# ------------------------------------------------------------------ secrets in every spelling

SECRET_VALUES = ("AKcamel-5f1e2d3c4b5a", "PWurl-9a8b7c6d5e4f", "XKheader-1a2b3c4d5e", "BTbearer-0f9e8d7c6b",
                 "AKeq-7e6d5c4b3a21", "sk-prod-8f2c1d9e7a6b5c4d3e2f1a0b")


def _secret_log(tmp_path: Path) -> Path:
    args = {**SEED_ARGS, "api_key": [SECRET_VALUES[5]],
            "kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {
                                       "ApiKey": SECRET_VALUES[0],
                                       "redis_url": f"redis://user:{SECRET_VALUES[1]}@h:6379",
                                       "headers": {"X-Api-Key": SECRET_VALUES[2]}}}}
    crash = "(EngineCore_DP2 pid=247) ERROR 08-19 19:52:31 [core.py:1332] EngineCore encountered a fatal error."
    return seed_log(tmp_path / "secrets.log", args, replace={crash: crash + "\n(APIServer pid=1) ERROR upstream "
                    f"said 401 to Authorization: Bearer {SECRET_VALUES[3]} (apiKey={SECRET_VALUES[4]})"})


def test_secrets_in_every_spelling_reach_no_output_and_no_file(tmp_path):
    """camelCase ApiKey, a URL's password, an X-Api-Key header, a Bearer token, apiKey=...: masked
    in triage's plain output, --json and the emitted matrix.yaml (issue 44)."""
    log = _secret_log(tmp_path)
    plain = kvrepro("triage", str(log))
    as_json = kvrepro("triage", str(log), "--json")
    emitted = kvrepro("triage", str(log), "--emit", str(tmp_path / "out"))
    for proc in (plain, as_json, emitted):
        assert proc.returncode == 0, proc.stderr[-2000:]
        for secret in SECRET_VALUES:
            assert secret not in proc.stdout + proc.stderr, secret
    assert "redis://user:***@h:6379" in as_json.stdout and '"ApiKey": "***"' in as_json.stdout
    files = "".join(p.read_text() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert not any(secret in files for secret in SECRET_VALUES)


@pytest.mark.parametrize("text, masked", [
    ("{'ApiKey': 'abc123'}", "{'ApiKey': '***'}"),
    ('"apiKey": "zzz"', '"apiKey": "***"'),
    ("redis://user:PW123@host:6379/0", "redis://user:***@host:6379/0"),
    ("X-Api-Key: k-9876", "X-Api-Key: ***"),
    ("Authorization: Bearer eyJhbGci", "Authorization: Bearer ***"),
    ("password=hunter2", "password=***"),
    ("'client_secret': 'cs'", "'client_secret': '***'"),
    ("accessToken=tok", "accessToken=***"),
    # what must stay: kvrepro's own words that look alike
    ("max_num_batched_tokens: 2048", None), ("build_key: 0.26.0+pr-1", None), ("http://host:8000/v1", None),
    ("num_speculative_tokens=1", None), ("sort_keys=True", None), ("ssh://git@github.com", None),
])
def test_redact_knows_every_spelling_and_leaves_lookalikes(text, masked):
    from kvrepro.secrets import redact

    assert redact(text) == (masked if masked is not None else text)


# ------------------------------------------------------------------ explore --resume

def _campaign(tmp_path: Path, runs: int = 0, budget: int = 1_000_000):
    from kvrepro.explore import new_campaign
    from kvrepro.explore.campaign import save
    from kvrepro.explore.state import CampaignRequest, RunRecord
    from kvrepro.explore.generator import RunSpec

    root = tmp_path / "results"
    state, folder = new_campaign(root, CampaignRequest(base="0.26.0", budget_runs=budget))
    state.runs = [RunRecord(spec=RunSpec(index=i), run_id=f"r{i}", verdict="SURVIVED", seconds=1.0)
                  for i in range(runs)]
    state.status = "interrupted"
    save(state, folder)
    return root, state, folder


def test_resume_refuses_a_campaign_without_the_schema_marker_and_pinned_options_given_again(tmp_path):
    """A campaign folder of another kvrepro (no schema marker), --base other than the pinned one,
    a --budget already spent: one line each, exit 2, explore.json untouched, no engine started."""
    import json

    root, state, folder = _campaign(tmp_path, runs=3)
    before = (folder / "explore.json").read_text()
    cid = state.campaign_id
    one_line(kvrepro("explore", "--resume", cid, "--base", "0.30.0", "--results", str(root)), 2,
             "--base 0.30.0 with --resume", "pinned at its start")
    one_line(kvrepro("explore", "--resume", cid, "--budget", "2", "--results", str(root)), 2,
             "has made 3 runs already", "whole budget")
    assert (folder / "explore.json").read_text() == before
    foreign = json.loads(before)
    del foreign["schema"]
    (folder / "explore.json").write_text(json.dumps(foreign))
    one_line(kvrepro("explore", "--resume", cid, "--results", str(root)), 2, "no schema marker",
             "start a new campaign")


@pytest.mark.parametrize("text, runs, seconds", [("20", 20, None), ("90s", None, 90.0), ("10d", None, 864_000.0),
                                                 ("1000000", 1_000_000, None)])
def test_budgets_within_the_limits(text, runs, seconds):
    from kvrepro.explore.campaign import parse_budget

    assert parse_budget(text) == (runs, seconds)


@pytest.mark.parametrize("text, says", [("99999999h", "at most 30d"), ("1000001", "at most 1,000,000 runs"),
                                        ("9" * 5000, "give a number of runs"), ("0", "give a number of runs"),
                                        ("1e9s", "give a number of runs")])
def test_budgets_beyond_the_limits_are_bad_input(text, says):
    from kvrepro.explore.campaign import parse_budget

    with pytest.raises(BadInputError, match=says) as exc:
        parse_budget(text)
    assert len(str(exc.value)) < 200


# ------------------------------------------------------------------ the sdist cache

def _fake_sdist(home: Path, release: str = "0.26.0", payload: bytes = b"def test_x():\n    pass\n") -> Path:
    """A cached sdist as fetch_sdist leaves one (the file and its sha256 sidecar), made here: the
    cache is real files, the index is not asked (the sidecar says the download checked out)."""
    import hashlib
    import io
    import tarfile

    folder = home / "sdists" / release
    folder.mkdir(parents=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo(f"vllm-{release}/tests/test_x.py")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    final = folder / f"vllm-{release}.tar.gz"
    final.write_bytes(buf.getvalue())
    (folder / f"vllm-{release}.tar.gz.sha256").write_text(hashlib.sha256(buf.getvalue()).hexdigest() + "\n")
    return final


def test_a_truncated_cached_sdist_is_a_damaged_cache_and_is_refetched_next_time(tmp_path, monkeypatch):
    """`builds test` reads the release's tests/ from the cached sdist: cut off since it was
    downloaded, it is "damaged cache" (SetupError: exit 3), removed, so the next run fetches it."""
    from kvrepro.builds import sdist
    from kvrepro.errors import SetupError

    monkeypatch.setenv("KVREPRO_HOME", str(tmp_path))
    final = _fake_sdist(tmp_path)
    assert sdist.source_tests("0.26.0").tests.joinpath("test_x.py").is_file()  # whole: unpacked

    final2 = _fake_sdist(tmp_path, "0.27.0")
    final2.write_bytes(final2.read_bytes()[: final2.stat().st_size // 2])
    with pytest.raises(SetupError, match="damaged cache: .*vllm-0.27.0.tar.gz: sha256 .* \\(cut off or changed since\\)"
                                         ".*run the command again to re-fetch it") as exc:
        sdist.source_tests("0.27.0")
    assert "\n" not in str(exc.value) and SetupError.exit_code == 3
    assert not final2.exists() and not final2.with_name(final2.name + ".sha256").exists()
    assert sdist._cached("0.27.0") is None  # the next run fetches it again


def test_a_full_disk_while_unpacking_names_the_folder(tmp_path):
    """A real tmpfs of 64 KiB as $KVREPRO_HOME (a private mount namespace): the sdist's tests do not
    fit; the error names the folder that could not be written, not only "No space left"."""
    import shutil as _shutil

    require(_shutil.which("unshare") is not None and os.geteuid() == 0, "needs root and unshare(1) for a private "
            "tmpfs mount")
    home = tmp_path / "home"
    home.mkdir()
    script = (f"mount -t tmpfs -o size=64k tmpfs {home} && {sys.executable} -c '"
              "import os, sys; from pathlib import Path\n"
              "sys.path.insert(0, sys.argv[1]); sys.path.insert(0, str(Path(sys.argv[1]) / \"tests\"))\n"
              "from test_hostile_logs import _fake_sdist\n"
              "from kvrepro.builds.sdist import source_tests\n"
              "from kvrepro.errors import SetupError\n"
              "_fake_sdist(Path(os.environ[\"KVREPRO_HOME\"]), payload=b\"x\" * (256 * 1024))\n"
              "try:\n    source_tests(\"0.26.0\")\nexcept SetupError as exc:\n    print(exc)\n"
              f"' {ROOT}")
    proc = subprocess.run(["unshare", "-m", "sh", "-ec", script], capture_output=True, text=True, timeout=HANG,
                          env={**os.environ, "KVREPRO_HOME": str(home)}, cwd=ROOT)
    said = proc.stdout.strip()
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert said.startswith(f"{home}/sdists/0.26.0: cannot write the sdist cache: No space left on device"), said


# ------------------------------------------------------------------ setup and patches that do not apply

def _matrix_with(tmp_path: Path, patches: dict, builds: dict) -> Path:
    import shutil as _shutil

    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    data["patches"].update(patches)
    data["builds"] = builds
    data.pop("expect", None)
    _shutil.copytree(ROOT / "builds", tmp_path / "builds")
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("builds, says", [
    ({"T": ["decoy-docstring", "decoy-docstring"]}, "patch 'decoy-docstring' twice in the stack"),
    ({"T": ["pr-49146"]}, "patch 'pr-49146' twice in common: and the build"),
])
def test_validate_refuses_a_patch_twice_in_a_stack(tmp_path, builds, says):
    path = _matrix_with(tmp_path, {}, builds)
    proc = kvrepro("matrix", "validate", "-m", str(path))
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_setup_exits_3_when_a_builds_patch_does_not_apply(tmp_path, runtime_python):
    """A `reverse: true` revert of a change 0.26.0 does not have: setup says the build failed (and
    which), exit 3 (it exited 0 after printing it)."""
    data = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    path = _matrix_with(tmp_path, {"undecoy": {**data["patches"]["decoy-docstring"], "reverse": True}},
                        {"A": [], "R": ["undecoy"]})
    proc = kvrepro("setup", "-m", str(path), timeout=900)
    assert proc.returncode == 3, (proc.stdout + proc.stderr)[-3000:]
    assert "build A: ok" in proc.stdout and "build R: failed" in proc.stdout, proc.stdout[-3000:]
    assert "1 of 2 build(s) not built (R)" in " ".join(proc.stderr.split()) and "Traceback" not in proc.stderr


# ------------------------------------------------------------------ what --run proved

def test_an_attention_only_log_expects_no_hybrid_corruption(tmp_path, catalogue):
    """tests/data/triage/build-store-jobs-0.26.0.log (DeepSeek, attention only) --run expected
    upstream-fix to be CORRUPT, and got VACUOUS: the expectation counted the catalogue's hybrid holes
    (fa-hole-below-mamba-hit, mamba-null-state: their signatures need a Mamba group) on a matrix
    with no Mamba group. The hybrid seed log still expects them."""
    found = triage_file(DATA / "build-store-jobs-0.26.0.log", catalogue)
    entry = next(e for e in catalogue.entries if e.name == found.best.entry)
    data, _ = build_matrix(found, entry, list(catalogue.entries), target_of(found))
    assert data["engine"]["geometry"]["mamba_groups"] == 0
    assert data["expect"] == {"as-deployed": "CRASH(target)", "upstream-fix": "SURVIVED|UNREACHED",
                              "minimal-clean-set": "SURVIVED|UNREACHED"}
    seed = triage_file(SEED, catalogue)
    seed_entry = next(e for e in catalogue.entries if e.name == seed.best.entry)
    assert build_matrix(seed, seed_entry, list(catalogue.entries), target_of(seed))[0]["expect"]["upstream-fix"] \
        == "CORRUPT"


def test_vacuous_proves_nothing_and_is_never_called_not_clean():
    """The words of `triage --run`: a build expected clean whose runs neither crashed nor read wrong
    KV is clean when the entry's own path counter ran (the suite's ABSENT), and "proves nothing"
    when it did not: never "NOT clean" (measured: build-store-jobs --run, 2026-12-04, upstream-fix
    VACUOUS with finished_unscheduled 8: clean, exit 0)."""
    from kvrepro.triage.run import Proof, what_it_proved

    lines = what_it_proved([
        Proof("upstream-fix", ("VACUOUS",), "SURVIVED|UNREACHED", True, "ABSENT", "path ran: finished_unscheduled 8"),
        Proof("minimal-clean-set", ("VACUOUS",), "SURVIVED|UNREACHED", False, "UNREACHED",
              "path below 1: finished_unscheduled 0"),
        Proof("minimal-clean-set", ("CORRUPT",), "SURVIVED|UNREACHED", False, "OTHER", ""),
        Proof("upstream-fix", ("VACUOUS",), "CORRUPT", False, "", ""),
    ])
    assert lines[0].endswith("is clean (no crash, no wrong KV); the failure's path ran (path ran: "
                             "finished_unscheduled 8)")
    assert lines[1].endswith("proves nothing: the failure's path never ran (path below 1: finished_unscheduled 0)")
    assert lines[2].endswith("is NOT clean: CORRUPT")
    assert lines[3].endswith("proves nothing: the trigger path never ran (VACUOUS)")
    assert not any("NOT clean" in line for line in lines[:2] + lines[3:])


# ------------------------------------------------------------------ reading: FIFOs, pipes, encodings, bombs

def _seed_bytes() -> bytes:
    return SEED.read_bytes()


@pytest.mark.parametrize("kind", ["gzip", "bzip2", "xz", "zstd", "utf-16", "cr-only"])
def test_every_way_a_log_comes_is_read_as_the_same_log(tmp_path, catalogue, kind):
    """Compressed (by magic bytes, whatever the name), UTF-16, \\r-only line ends: the same triage
    as the plain seed log (they were "binary", or one long line, before)."""
    import bz2
    import gzip
    import lzma

    raw = _seed_bytes()
    path = tmp_path / "incident.log"
    if kind == "gzip":
        path.write_bytes(gzip.compress(raw))
    elif kind == "bzip2":
        path.write_bytes(bz2.compress(raw))
    elif kind == "xz":
        path.write_bytes(lzma.compress(raw))
    elif kind == "zstd":
        import shutil as _shutil

        require(_shutil.which("zstd") is not None, "the zstd program")
        subprocess.run(["zstd", "-q", "-f", "-o", str(path), str(SEED)], check=True)
    elif kind == "utf-16":
        path.write_bytes(raw.decode().encode("utf-16"))
    else:
        path.write_bytes(raw.replace(b"\n", b"\r"))
    plain, found = triage_file(SEED, catalogue), triage_file(path, catalogue)
    assert (found.best.entry, found.failure.line, found.lines, found.config.block_size) == \
        (plain.best.entry, plain.failure.line, plain.lines, plain.config.block_size)
    if kind in ("utf-16", "cr-only"):
        assert any("read as" in w for w in found.warnings), found.warnings


def test_a_truncated_compressed_log_says_where(tmp_path):
    import gzip

    cut = tmp_path / "cut.log.gz"
    cut.write_bytes(gzip.compress(_seed_bytes() * 40)[:4000])
    line = one_line(kvrepro("triage", str(cut)), 2, "damaged gzip data at byte 4,000 of 4,000", "lines)",
                    "the file ends inside the gzip data")
    assert "after 0 bytes" not in line


def test_a_fifo_is_refused_at_once_and_a_pipe_is_read(tmp_path):
    fifo = tmp_path / "incident.log"
    os.mkfifo(fifo)
    one_line(kvrepro("triage", str(fifo), timeout=60), 2, "a FIFO (named pipe)", "pipe it in")
    for name in ("-", "/dev/stdin"):
        with open(SEED, "rb") as fh:
            piped = subprocess.run(["sh", "-c", f'cat "$1" | "$2" -m kvrepro.cli triage {name} --json', "sh", str(SEED),
                                    sys.executable], capture_output=True, text=True, timeout=HANG, cwd=ROOT, stdin=fh)
        assert piped.returncode == 0, piped.stderr[-2000:]
        assert '"best": "offload-boundary-assert"' in piped.stdout


def test_a_line_bomb_is_cut_and_said_and_the_lines_after_it_keep_their_numbers(tmp_path, catalogue):
    """64 MiB on one line (a 64 KiB gzip) before the traceback: cut to 1 MiB with a warning naming
    its line, the crash found at its own line. Memory: benchmarks/hostile_logs.py (flat RSS)."""
    import zlib

    lines = _seed_bytes().split(b"\n")
    packer = zlib.compressobj(6, zlib.DEFLATED, 31)
    body = [packer.compress(b"\n".join(lines[:18]) + b"\n(APIServer pid=1) ERROR ")]
    body += [packer.compress(b"A" * (1 << 20)) for _ in range(64)]
    body += [packer.compress(b"\n" + b"\n".join(lines[18:])), packer.flush()]
    bomb = tmp_path / "bomb.log.gz"
    bomb.write_bytes(b"".join(body))
    found, plain = triage_file(bomb, catalogue), triage_file(SEED, catalogue)
    assert found.best.entry == plain.best.entry and found.failure.line == plain.failure.line + 1
    cut = f"{bomb}:19: a line of 67,108,888 bytes, cut to its first 1,048,576"
    assert any(w.startswith(cut) for w in found.warnings), found.warnings


def test_huge_numbers_and_versions_are_one_short_line(tmp_path, catalogue):
    from kvrepro.triage import render
    from kvrepro.triage.commands import check_release

    digits = "9" * 100_000
    banner = "vLLM API server version"
    # issue 45: a text is triaged, never refused for what it says; a 100,000-digit "version" is read as none
    version = seed_log(tmp_path / "v.log", replace={f"{banner} 0.26.0": f"{banner} {digits}.0.0",
                                                    "engine (v0.26.0)": f"engine (v0.26.{digits})"})
    proc = kvrepro("triage", str(version))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert all(len(line) <= 80 for line in proc.stdout.splitlines()) and digits[:100] not in proc.stdout
    assert "warning: no vLLM version in the text" in proc.stdout
    for release, says in ((digits, "--release 99999"), ("junk", "--release junk: not a vLLM release")):
        with pytest.raises(BadInputError, match=says) as exc:
            check_release(release)
        assert len(str(exc.value)) < 300
    numbers = seed_log(tmp_path / "n.log", args_text="{'tensor_parallel_size': " + digits + ", 'block_size': 1e999999}")
    shown = render.plain(triage_file(numbers, catalogue))
    assert all(len(line) <= 80 for line in shown) and digits[:100] not in "".join(shown)


def test_a_binary_a_zip_and_an_empty_log_are_one_line(tmp_path, catalogue):
    import zipfile

    binary = tmp_path / "core"
    binary.write_bytes(os.urandom(1 << 16))
    one_line(kvrepro("triage", str(binary)), 2, "not a text log (binary data")
    archive = tmp_path / "logs.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("vllm.log", _seed_bytes())
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    for path, says in ((archive, "a zip archive, not a log; unpack it"), (empty, "is empty"),
                       (Path("/dev/zero"), "character device")):
        with pytest.raises(BadInputError, match=says):
            triage_file(path, catalogue)


def test_every_value_triage_shows_is_one_printable_line(tmp_path, catalogue):
    """The same injections in every value triage reads and prints (args, the exception's message,
    the backend, the scheduling policy): the plain output is lines of at most 80 columns with no
    control character, and the JSON output parses to the same values (JSON escapes them)."""
    import json

    from kvrepro.triage import render

    evil = INJECTIONS[0] + INJECTIONS[3] + "\x1b[31m"
    args = {**SEED_ARGS, "model_tag": evil, "kv_offloading_backend": evil, "scheduling_policy": evil,
            "speculative_config": {"method": "mtp" + evil, "num_speculative_tokens": 1}}
    raw = "x\u2028y\x1b[31m\x07z\x85w\rv"  # a line may hold these raw (only \n ends one)
    log = seed_log(tmp_path / "evil.log", args, replace={"] AssertionError\n": f"] AssertionError: {raw} {evil!r}\n"})
    found = triage_file(log, catalogue)
    lines = render.plain(found)
    assert all(len(line) <= 80 and line.isprintable() for line in lines), [ln for ln in lines if not ln.isprintable()]
    assert repr(evil)[:20] in found.failure.exception_line  # the message was read (as the log has it)
    assert json.loads(json.dumps(render.as_json(found)))["config"]["model"] == evil
