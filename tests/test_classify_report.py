"""One engine log, one parse (issue 49): a log followed while it grows (the runner's LogTail) says
what the same log parsed whole says, each byte read once; `kvrepro classify` opens its log once;
the target-crash rule is one function. Real log files of tests/data/logs/, real files on disk."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest

from conftest import ROOT
from kvrepro.classify import LogParser, LogTail, is_target_crash, parse_log
from kvrepro.records import Signature
from kvrepro.spec.matrix import TargetSignature

LOGS = ROOT / "tests" / "data" / "logs"


def _facts(parsed) -> tuple:
    return (parsed.classification, parsed.exposure, parsed.counters, parsed.geometries, parsed.last_line,
            parsed.capacity.gpu_tokens, parsed.capacity.block_tokens, parsed.lines)


@pytest.mark.parametrize("name", ["sim-target.log", "shadow-fa-hole.log", "serve-0.26-target.log",
                                  "engine-failed-to-start.log"])
def test_a_log_followed_in_pieces_says_what_the_whole_log_says(tmp_path, name):
    data = (LOGS / name).read_bytes()
    # what the runner did before: the whole file as text (universal newlines), parsed once
    whole = parse_log((LOGS / name).read_text(errors="replace"))
    # written in pieces that cut lines, a "\r\n" and a UTF-8 character in two, with no final newline
    data = data.replace(b"\n", b"\r\n", 3).rstrip(b"\n") + "\n\u00e9 last words".encode()
    expected = parse_log(io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="replace").read())
    path = tmp_path / "engine.log"
    path.write_bytes(b"")
    tail = LogTail(path, LogParser())
    cuts = sorted({0, len(data), *range(7, len(data), max(1, len(data) // 9)), data.index(b"\r\n") + 1,
                   len(data) - len(" last words".encode()) - 1})
    for lo, hi in zip(cuts, cuts[1:]):
        with path.open("ab") as fh:
            fh.write(data[lo:hi])
        tail.read()
    followed = tail.finish()
    assert _facts(followed) == _facts(expected)
    assert followed.last_line == "\u00e9 last words"
    assert tail.offset == len(data) and tail.reads == len(cuts)  # each byte read once, one open per look
    if name != "engine-failed-to-start.log":
        assert whole.classification == expected.classification


def test_the_exposure_so_far_grows_with_the_log(tmp_path):
    lines = (LOGS / "shadow-fa-hole.log").read_text().splitlines(keepends=True)
    path = tmp_path / "engine.log"
    path.write_text("".join(lines[: len(lines) // 2]))
    tail = LogTail(path, LogParser())
    half = tail.read().exposure()
    with path.open("a") as fh:
        fh.write("".join(lines[len(lines) // 2:]))
    full = tail.read().exposure()
    assert full == parse_log("".join(lines)).exposure
    assert half.kv_checks <= full.kv_checks and full.kv_violations > 0


def test_kvrepro_classify_opens_its_log_once(monkeypatch):
    from kvrepro.classify import commands, logfile

    opened = []
    real = logfile.open_log

    def counted(*args, **kwargs):
        opened.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(logfile, "open_log", counted)
    verdict = commands.classify_command(LOGS / "shadow-fa-hole.log", None, TargetSignature())
    assert len(opened) == 1
    assert verdict.defects and verdict.as_json["kv_violations"] > 0


def test_the_one_target_rule_reads_statements_canonically():
    """What the minimizer's copies got wrong: a qualified exception name, a ``./`` file, a statement
    laid out otherwise (canonical() compares what it computes)."""
    target = TargetSignature(file="./vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
                             exception="builtins.AssertionError",
                             expression="num_locally_computed_tokens <= num_locally_computed_gpu_blocks*tokens_per_block")
    sig = Signature("AssertionError", "OffloadingConnectorScheduler.update_state_after_alloc",
                    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", 815,
                    "assert (num_locally_computed_tokens\n <= num_locally_computed_gpu_blocks * tokens_per_block)")
    assert is_target_crash(sig, target)
    assert not is_target_crash(dataclasses.replace(sig, expression="assert a == b"), target)
    assert is_target_crash(dataclasses.replace(sig, expression=""), target, statement_known=False)
    assert not is_target_crash(dataclasses.replace(sig, exception="ValueError"), target)
    assert not is_target_crash(None, target)
