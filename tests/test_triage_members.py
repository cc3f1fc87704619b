"""kvrepro triage on the real reports of the catalogue's tracker members (issue 45 item 5).

tests/data/triage/members/ holds only what each vLLM issue or PR pasted (its README cites them);
triage must name the member's catalogue entry first. Real reports are partial (an exception line,
a frame summary, a command line); triage names the member from what the text shows of its failure.
A report whose text holds no failure is a strict xfail (PARTIAL): the first one that passes fails
the run and its marker comes off. Reading the reports runs no engine.
"""

from __future__ import annotations

import re

import pytest

from conftest import ROOT
from kvrepro.errors import BadInputError
from kvrepro.suite.run import load as load_catalogue
from kvrepro.triage import triage_file

MEMBERS = ROOT / "tests" / "data" / "triage" / "members"
_ROW = re.compile(r"^\| `(?P<log>[^`]+\.log)` \| `(?P<entry>[a-z0-9-]+)` \| \[vllm#\d+\]\((?P<url>https://github\.com/vllm-project/vllm/(?:issues|pull)/\d+)\)")


def _cases() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in (MEMBERS / "README.md").read_text().splitlines():
        if (m := _ROW.match(line)) is not None:
            rows[m["log"]] = (m["entry"], m["url"])
    return rows


CASES = _cases()
# reports whose text, as the search tool shows it, does not hold the failure (a command or a connector
# config only, or a traceback cut before its failing frame): triage says unknown for them, and naming
# the entry would be a guess from resemblance (issue 45). Strict: the first one that passes fails the run.
PARTIAL = {"45414-no-connector-stall.log", "49635-tiering-final-store.log", "52170-multiconnector-store.log",
           "55503-tiering-mtp-store.log"}


@pytest.fixture(scope="module")
def catalogue():
    return load_catalogue()


def test_every_member_log_is_listed_with_its_thread_and_entry(catalogue):
    logs = {p.name for p in MEMBERS.glob("*.log")}
    assert logs and logs == set(CASES)
    names = {e.name for e in catalogue.entries}
    for log, (entry, url) in CASES.items():
        assert entry in names, f"{log}: no catalogue entry {entry}"
        header = (MEMBERS / log).read_text().splitlines()[0]
        assert header.startswith("# ") and url in header, f"{log}: its first line names {url}"
        assert url in next(e for e in catalogue.entries if e.name == entry).upstream, (log, url)


@pytest.mark.parametrize("log", sorted(CASES))
def test_the_real_report_names_its_entry_first(log, catalogue, request):
    if log in PARTIAL:
        request.applymarker(pytest.mark.xfail(
            raises=(AssertionError, BadInputError), strict=True,
            reason="the text shows no failure of the member: unknown is the answer it supports"))
    found = triage_file(MEMBERS / log, catalogue)
    entry, _ = CASES[log]
    assert found.best is not None and found.best.entry == entry, [m.entry for m in found.matches]
