"""issue 49: a new deploy target is one folder. A target planted as a new module of kvrepro.deploy
(``fake.py`` in a folder added to the package's path, never a file of kvrepro's) is picked up by
every stage that asks what a target can do: the suite and explore share one instance of it, bisect
probes commits on it, `matrix plan` shows its GPU-free engine arguments, `builds test` runs vLLM's
tests through its runner; and one that says nothing gets none of that. The fake target is planted
because the point is a target kvrepro does not ship (it starts no engine: each stage's runner call
is replaced where it would start one); the registry's discovery, the stages and the matrices they
build are the real ones."""

from __future__ import annotations

import importlib
import json
import sys
import types

import pytest

import kvrepro.deploy as deploy
from kvrepro.errors import KvreproError, SpecError
from kvrepro.suite.run import load as load_catalogue

from conftest import ROOT

_FAKE = """
from kvrepro.deploy import register
from kvrepro.deploy.base import Target


class Runner:
    closed = False

    def close(self):
        self.closed = True


RUNNER = Runner()
{capabilities}

@register("fake")
class FakeTarget(Target):
    def prepare(self, plan):
        raise AssertionError("the planted target prepares nothing")

    def start(self, artifact, run_dir, rep):
        raise AssertionError("the planted target starts nothing")
"""
_CAPABLE = """
SHARED = BUILDS_COMMITS = GPU_FREE = True


def upstream_tests(loaded, base, on_line):
    return RUNNER
"""


@pytest.fixture(params=[True, False], ids=["capable", "plain"])
def fake(request, monkeypatch, tmp_path):
    """``kvrepro.deploy.fake``: with every capability a target module can declare, or with none; found
    by the registry as any target is (a module in the package's folders), gone after the test."""
    (tmp_path / "fake.py").write_text(_FAKE.format(capabilities=_CAPABLE if request.param else ""))
    monkeypatch.setattr(deploy, "__path__", [*deploy.__path__, str(tmp_path)])
    monkeypatch.setattr(deploy, "_TARGETS", dict(deploy._TARGETS))  # its registration goes with the test
    monkeypatch.delitem(sys.modules, "kvrepro.deploy.fake", raising=False)
    assert "fake" in deploy.known_targets()
    module = importlib.import_module("kvrepro.deploy.fake")
    yield types.SimpleNamespace(capable=request.param, runner=module.RUNNER, cls=module.FakeTarget)
    sys.modules.pop("kvrepro.deploy.fake", None)


def test_the_registry_answers_for_a_planted_target(fake):
    assert deploy.get_target("fake") is fake.cls
    for question in (deploy.shares_one_instance, deploy.builds_commits, deploy.engine_always_gpu_free,
                     deploy.runs_upstream_tests):
        assert question("fake") is fake.capable
        assert ("fake" in deploy.with_capability(question)) is fake.capable


def _hand_over(monkeypatch, module) -> list:
    """``module``'s matrix runner replaced by one that records the target it is handed and runs nothing."""
    handed = []

    def run_matrix(loaded, options, progress, stop, target=None):
        handed.append(target)
        raise KvreproError("not run here")

    monkeypatch.setattr(module, "run_matrix", run_matrix)
    return handed


def test_the_suite_shares_a_planted_target_that_says_so(fake, monkeypatch, tmp_path):
    import kvrepro.suite.run as suite_run

    handed = _hand_over(monkeypatch, suite_run)
    catalogue = load_catalogue()
    chosen = [e for e in catalogue.entries if e.name == "offload-boundary-assert"]
    suite_run.run_suite(catalogue, chosen, suite_run.parse_builds(["0.30.0"], []), tmp_path, jobs=1, target="fake")
    assert len(handed) == 1
    assert isinstance(handed[0], fake.cls) if fake.capable else handed[0] is None


def test_explore_shares_a_planted_target_that_says_so(fake, monkeypatch, tmp_path):
    from kvrepro.explore import campaign as campaign_module
    from kvrepro.explore.campaign import new_campaign, run_campaign
    from kvrepro.explore.state import CampaignRequest

    handed = _hand_over(monkeypatch, campaign_module)
    state, folder = new_campaign(tmp_path, CampaignRequest(base="0.30.0", budget_runs=1, seed=1, requests=10,
                                                           guided=False, target="fake"))
    done = run_campaign(state, folder, load_catalogue())
    assert [r.verdict for r in done.runs] == ["INFRA"] and len(handed) == 1
    assert isinstance(handed[0], fake.cls) if fake.capable else handed[0] is None


def test_bisect_probes_commits_on_a_planted_target_that_builds_them(fake):
    from kvrepro.bisect import _commits_need_sim

    def request(target):
        return types.SimpleNamespace(target=target), types.SimpleNamespace(
            loaded=types.SimpleNamespace(matrix=types.SimpleNamespace(target="sim")))

    if fake.capable:
        _commits_need_sim(*request("fake"))
    else:
        with pytest.raises(SpecError, match=r"--target fake: .*\(sim;"):
            _commits_need_sim(*request("fake"))
    with pytest.raises(SpecError, match=r"--target docker: commits can only be probed on a target that builds"):
        _commits_need_sim(*request("docker"))


def test_matrix_plan_shows_a_gpu_free_targets_engine_arguments(fake, capsys):
    from kvrepro.matrix.commands import plan

    plan(ROOT / "matrix.yaml", "fake", as_json=True)
    planned = json.loads(capsys.readouterr().out)
    assert planned["target"] == "fake"
    assert ("--num-gpu-blocks-override" in planned["engine_args"]) is fake.capable


def test_builds_test_runs_through_a_planted_targets_runner(fake, monkeypatch, tmp_path):
    import kvrepro.builds as builds
    from kvrepro.builds import upstream_tests
    from kvrepro.errors import BadInputError
    from kvrepro.matrix import load_matrix
    from kvrepro.report.upstream_tests import run_builds_test

    handed = {}

    def check_builds(plans, patches, runtime, *, runner, command, **kwargs):
        handed.update(runner=runner, command=command)
        raise KvreproError("not run here")

    monkeypatch.setattr(builds, "prepare_runtime", lambda base, on_line=None: None)
    monkeypatch.setattr(upstream_tests, "check_builds", check_builds)
    loaded = load_matrix(ROOT / "matrix.yaml")
    if not fake.capable:
        with pytest.raises(BadInputError, match=r"--target fake: builds test runs here \(local\) or on a target "
                                                r"that runs vLLM's tests \(ray, sim\)"):
            run_builds_test(loaded, None, [], [], 1, tmp_path, True, target="fake")
        return
    with pytest.raises(KvreproError, match="not run here"):
        run_builds_test(loaded, None, [], [], 1, tmp_path, True, target="fake")
    assert handed["runner"] is fake.runner and fake.runner.closed
    assert handed["command"].endswith(" --target fake")
