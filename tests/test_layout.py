"""The package's folders are the pipeline: no module imports a later stage, no import circle,
few loose modules (scripts/import_graph.py measures all three from the code's own imports)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def _graph() -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_graph.py"), "--json"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.stdout, proc.stderr
    return json.loads(proc.stdout)


def test_no_module_imports_a_later_stage_and_there_is_no_circle():
    graph = _graph()
    assert graph["later_stage_imports"] == []
    assert graph["circles"] == []


def test_the_top_level_holds_only_shared_modules_and_the_cli():
    graph = _graph()
    assert graph["loose_top_level_modules"] <= 10, graph["loose"]
    for stage in ("spec", "builds", "deploy", "engine", "loadgen", "classify", "results", "report",
                  "matrix", "bisect", "minimize"):
        assert stage in graph["stage_folders"]


def test_the_checker_finds_a_later_stage_import_and_a_circle(tmp_path):
    """The measurement itself can fail: a copy of the package with a planted back-arrow and circle."""
    import shutil

    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "kvrepro", copy / "kvrepro", ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copytree(ROOT / "scripts", copy / "scripts")
    spec = copy / "kvrepro" / "spec" / "geometry.py"
    spec.write_text(spec.read_text() + "\n\ndef _planted():\n    from ..report import stats  # noqa\n")
    errors = copy / "kvrepro" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _planted():\n    from . import paths  # noqa\n")
    paths = copy / "kvrepro" / "paths.py"
    paths.write_text(paths.read_text() + "\n\ndef _planted():\n    from . import errors  # noqa\n")
    proc = subprocess.run([sys.executable, str(copy / "scripts" / "import_graph.py"), "--json"],
                          capture_output=True, text=True)
    graph = json.loads(proc.stdout)
    assert proc.returncode == 1
    assert {"importer": "kvrepro.spec.geometry", "imported": "kvrepro.report.stats"} in graph["later_stage_imports"]
    assert ["kvrepro.errors", "kvrepro.paths"] in graph["circles"]


def test_each_target_checks_its_own_settings(monkeypatch):
    """kvrepro.deploy.check_settings applies every target module's optional check_settings: a new
    target with matrix settings is still one file (kvrepro.matrix names no target)."""
    import sys
    import types

    import kvrepro.deploy as deploy

    from kvrepro.spec.matrix import Matrix

    seen = []
    fake = types.ModuleType("kvrepro.deploy.fake")
    fake.check_settings = seen.append
    monkeypatch.setitem(sys.modules, "kvrepro.deploy.fake", fake)
    monkeypatch.setattr(deploy, "known_targets", lambda: ["sim", "fake"])
    matrix = Matrix.model_validate({"builds": {"A": []}})
    deploy.check_settings(matrix)
    assert seen == [matrix]
    from pathlib import Path

    assert "deploy.docker" not in (Path(deploy.__file__).parent.parent / "matrix" / "__init__.py").read_text()


def _private_imports_across_folders(package) -> list[str]:
    """``from <module in another folder> import _name``: every such import in ``package`` (a
    folder holding kvrepro/), read with ast (function-level imports count too)."""
    import ast

    found = []
    for path in sorted((package / "kvrepro").rglob("*.py")):
        if "data" in path.relative_to(package).parts:
            continue
        folder = path.parent.relative_to(package).parts
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = folder[: len(folder) - (node.level - 1)]
                module = base + tuple(node.module.split(".") if node.module else ())
            else:
                module = tuple((node.module or "").split("."))
            if module[0] != "kvrepro":
                continue
            # the folder the imported module lives in: a module file's parent, or the package itself
            is_file = package.joinpath(*module).with_suffix(".py").is_file()
            home = module[:-1] if is_file else module
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") and home != folder:
                    found.append(f"{path.relative_to(package)}: {'.'.join(module)}.{alias.name}")
    return found


def test_no_private_name_is_imported_across_folders(tmp_path):
    """A ``_name`` is its folder's own: another folder that needs it needs a public name. The check
    also finds one planted in a copy (it can fail)."""
    import shutil

    assert _private_imports_across_folders(ROOT) == []
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "kvrepro", copy / "kvrepro", ignore=shutil.ignore_patterns("__pycache__", "data"))
    trace = copy / "kvrepro" / "loadgen" / "trace.py"
    trace.write_text(trace.read_text() + "\n\ndef _planted():\n    from ..records import _planted_name  # noqa\n")
    runner = copy / "kvrepro" / "loadgen" / "runner.py"
    runner.write_text(runner.read_text() + "\n\ndef _planted():\n    from .trace import _same_folder  # noqa\n")
    assert _private_imports_across_folders(copy) == ["kvrepro/loadgen/trace.py: kvrepro.records._planted_name"]


def test_a_new_target_owns_its_section_of_the_matrix(monkeypatch, tmp_path):
    """A target (here a planted `k8s` module) declares the top-level section it owns and checks it:
    the spec keeps it as written, the target types it with file:line errors, and a key no target
    owns is refused the same way. Neither spec/ nor matrix/ changes for it. The k8s target is planted
    (no Kubernetes cluster runs here, and the point is a target kvrepro does not ship); the matrix
    parsing and the deploy registry it goes through are the real ones."""
    import sys
    import types

    import pytest

    import kvrepro.deploy as deploy
    from kvrepro.errors import SpecError
    from kvrepro.matrix import parse_matrix
    from kvrepro.spec.matrix import FieldError

    def check_settings(matrix):
        namespace = (matrix.section("k8s") or {}).get("namespace", "default")
        if not isinstance(namespace, str):
            raise FieldError(("k8s", "namespace"), "a Kubernetes namespace name")

    k8s = types.ModuleType("kvrepro.deploy.k8s")
    k8s.SECTIONS, k8s.check_settings = ("k8s",), check_settings
    monkeypatch.setitem(sys.modules, "kvrepro.deploy.k8s", k8s)
    monkeypatch.setattr(deploy, "known_targets", lambda: ["docker", "k8s", "ray", "sim"])
    text = "builds:\n  A: []\nk8s:\n  namespace: {}\n"
    path = tmp_path / "matrix.yaml"
    assert parse_matrix(text.format("kv"), path).matrix.section("k8s") == {"namespace": "kv"}
    with pytest.raises(SpecError, match=r"matrix.yaml:4: k8s.namespace: a Kubernetes namespace name"):
        parse_matrix(text.format("[1]"), path)
    with pytest.raises(SpecError, match=r"matrix.yaml:3: k8z: unknown field; allowed here: .*k8s"):
        parse_matrix(text.format("kv").replace("k8s:", "k8z:"), path)


def _target_branches(package, targets=None) -> list[str]:
    """Every place that branches on a target's name outside that target's own module or package
    (``kvrepro/deploy/<name>.py`` or ``kvrepro/deploy/<name>/``): a comparison (``==``, ``!=``,
    ``in``, ``not in``) or a ``match`` case with the name as a string on either side, or a tuple,
    list or set made of target names only (a list of targets to test against), read with ast.
    The names are the registry's (kvrepro.deploy.known_targets of ``package``'s own deploy/ folder,
    or ``targets``), so a new target is covered the day its folder appears. Such a branch is the
    target's knowledge living elsewhere; a stage asks kvrepro.deploy instead (get_target,
    shares_one_instance, builds_commits, node_engine, ...)."""
    import ast
    import pkgutil

    if targets is None:
        targets = sorted(m.name for m in pkgutil.iter_modules([str(package / "kvrepro" / "deploy")]) if m.name not in ("base", "records"))

    def named(node) -> set[str]:
        if isinstance(node, ast.Constant):
            return {node.value} & set(targets)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(named(e) for e in node.elts)) if node.elts else set()
        return set()

    def owner(rel) -> str | None:
        parts = rel.parts
        if parts[:2] != ("kvrepro", "deploy") or len(parts) < 3:
            return None
        return parts[2].removesuffix(".py") if len(parts) == 3 else parts[2]

    found = []
    for path in sorted((package / "kvrepro").rglob("*.py")):
        rel = path.relative_to(package)
        if "data" in rel.parts:
            continue
        home = owner(rel)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                names = set().union(*(named(n) for n in (node.left, *node.comparators)))
            elif isinstance(node, ast.MatchValue):
                names = named(node.value)
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and all(
                    isinstance(e, ast.Constant) and e.value in targets for e in node.elts):
                names = named(node)  # a list of targets kept elsewhere (explore's SHARED_TARGETS was one)
            else:
                continue
            if names - {home}:
                found.append(f"{rel}:{node.lineno}")
    return sorted(found, key=lambda where: (where.partition(":")[0], int(where.partition(":")[2])))


def test_no_target_branch_outside_its_own_folder(tmp_path):
    """issue 29 for docker, issue 49 for every target: a target's knowledge is in its own module or
    package only (the ray target runs another's engine on its nodes through
    kvrepro.deploy.node_engine; explore, the suite, bisect, `builds test` and `matrix plan` ask
    kvrepro.deploy what a target can do). The check finds branches planted in a copy, on a target
    the registry gained by a new folder too."""
    import shutil

    assert _target_branches(ROOT) == []
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "kvrepro", copy / "kvrepro", ignore=shutil.ignore_patterns("__pycache__", "data"))
    node = copy / "kvrepro" / "deploy" / "ray" / "node.py"
    lines = len(node.read_text().splitlines())
    node.write_text(node.read_text() + "\n\ndef _planted(job):\n    return job.engine == 'docker'\n")
    runner = copy / "kvrepro" / "matrix" / "runner.py"
    runner.write_text(runner.read_text() + "\n\ndef _planted(target):\n    match target:\n        case \"docker\":\n"
                      "            return 1\n    return target not in ('sim', 'docker')\n")
    runner_lines = len(runner.read_text().splitlines())
    suite = copy / "kvrepro" / "suite" / "run.py"
    suite.write_text(suite.read_text() + "\n\ndef _planted(name):\n    return name != 'sim' or name == \"ray\"\n")
    suite_lines = len(suite.read_text().splitlines())
    inside = copy / "kvrepro" / "deploy" / "docker" / "target.py"  # the docker target may name itself
    inside.write_text(inside.read_text() + "\n\ndef _planted(name):\n    return name == 'docker'\n")
    sim = copy / "kvrepro" / "deploy" / "sim.py"  # so may the sim target, in its module
    sim.write_text(sim.read_text() + "\n\ndef _planted(name):\n    return name == 'sim'\n")
    (copy / "kvrepro" / "deploy" / "k8s").mkdir()  # a new target's folder: its name is ruled at once
    (copy / "kvrepro" / "deploy" / "k8s" / "__init__.py").write_text("def _planted(name):\n    return name == 'k8s'\n")
    explore = copy / "kvrepro" / "explore" / "campaign.py"
    explore.write_text(explore.read_text() + "\n\nSHARED = ('sim', 'ray')\nNOT_TARGETS = ('docker', 'podman')\n\n\n"
                       "def _planted(name):\n    return name in {'k8s'}\n")
    explore_lines = len(explore.read_text().splitlines())
    assert _target_branches(copy) == [f"kvrepro/deploy/ray/node.py:{lines + 4}",
                                      f"kvrepro/explore/campaign.py:{explore_lines - 5}",  # SHARED, not NOT_TARGETS
                                      f"kvrepro/explore/campaign.py:{explore_lines}",  # the compare and its set
                                      f"kvrepro/explore/campaign.py:{explore_lines}",
                                      f"kvrepro/matrix/runner.py:{runner_lines - 2}",
                                      f"kvrepro/matrix/runner.py:{runner_lines}",  # the compare and its tuple
                                      f"kvrepro/matrix/runner.py:{runner_lines}",
                                      f"kvrepro/suite/run.py:{suite_lines}",  # 'sim' and "ray", one each
                                      f"kvrepro/suite/run.py:{suite_lines}"]


# issue 49: what a log means is decided in one place. The target-crash rule is
# kvrepro.classify.is_target_crash; a known crash pattern's own match (classify/patterns.py, and
# triage's fit of partial evidence to a pattern) are the only other comparisons of two exceptions. The `kvrepro-sim: geometry` line has one parser
# (spec/geometry.py) beside its one writer (engine/executor.py).
_TARGET_RULE_OWNERS = {("kvrepro/classify/classifier.py", "is_target_crash"), ("kvrepro/classify/patterns.py", "match"),
                       # triage's fit of partial evidence (no whole traceback) to a known pattern
                       ("kvrepro/triage/failure.py", "match_partial")}
_GEOMETRY_OWNERS = {"kvrepro/spec/geometry.py", "kvrepro/engine/executor.py"}


def _planted(tmp_path, text: str):
    """A folder holding a kvrepro/ whose one module, minimize/planted.py, is ``text`` (for a check
    to find what is planted there)."""
    plant = tmp_path / "repo" / "kvrepro" / "minimize"
    plant.mkdir(parents=True)
    (plant / "planted.py").write_text(text)
    return tmp_path / "repo"


def _modules(package):
    """(path relative to ``package``, syntax tree, ids of its docstring nodes) of each module of
    ``package``'s kvrepro/, its data/ left out."""
    import ast

    for path in sorted((package / "kvrepro").rglob("*.py")):
        rel = path.relative_to(package)
        if "data" in rel.parts:
            continue
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        yield rel, tree, docstrings


def _second_log_rules(package) -> list[str]:
    """Where ``package`` (a folder holding kvrepro/) decides "is this the target crash" outside its
    one function (an ``==``/``!=`` with an ``.exception`` on both sides), or parses the geometry
    line outside its one parser (a string, not a docstring, holding ``kvrepro-sim: geometry``)."""
    import ast

    found = []
    for path in sorted((package / "kvrepro").rglob("*.py")):
        if "data" in path.relative_to(package).parts:
            continue
        name = path.relative_to(package).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        # the innermost function around each line
        spans = sorted(((n.lineno, n.end_lineno, n.name) for n in ast.walk(tree)
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), key=lambda s: s[1] - s[0])
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                sides = [node.left, *node.comparators]
                with_exception = [any(isinstance(x, ast.Attribute) and x.attr == "exception" for x in ast.walk(side))
                                  for side in sides]
                function = next((f for lo, hi, f in spans if lo <= node.lineno <= hi), "")
                if sum(with_exception) >= 2 and (name, function) not in _TARGET_RULE_OWNERS:
                    found.append(f"{name}:{node.lineno}: target-crash rule in {function or 'module'}")
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and "kvrepro-sim: geometry" in node.value and name not in _GEOMETRY_OWNERS):
                found.append(f"{name}:{node.lineno}: geometry line parsed")
    return found


def test_one_target_crash_rule_and_one_geometry_parser(tmp_path):
    """The checks find a second rule and a second parser planted in a copy (they can fail)."""
    assert _second_log_rules(ROOT) == []
    repo = _planted(
        tmp_path,
        '"""kvrepro-sim: geometry in a docstring is words, not a parse."""\nimport re\n\n\n'
        "def minimizable(s, target):\n    return s.exception == target.exception.rsplit('.', 1)[-1]\n\n\n"
        "_GEOMETRY = re.compile(r'kvrepro-sim: geometry .*?block_size=(\\d+)')\n\n\n"
        "def match(sig, pattern):  # the name of patterns.py's owner, in another file\n"
        "    return sig.exception != pattern.exception\n")
    assert _second_log_rules(repo) == [
        "kvrepro/minimize/planted.py:6: target-crash rule in minimizable",
        "kvrepro/minimize/planted.py:9: geometry line parsed",
        "kvrepro/minimize/planted.py:13: target-crash rule in match",
    ]


def test_the_runner_reads_its_engine_log_through_the_one_parser():
    """matrix/runner.py takes what a log says from classify.report's ParsedLog: it neither reads
    the log's text nor calls a reader of its own (classify_log, read_exposure, ...)."""
    text = (ROOT / "kvrepro" / "matrix" / "runner.py").read_text()
    for second in ("read_text(", "classify_log", "classify_lines", "read_exposure", "read_engine_counters",
                   "LogFollower"):
        assert second not in text, second


# issue 49: records by stage. The shared base (kvrepro/records.py) holds only what every stage from
# the targets to the report passes on; each other record lives in the records module of a stage that
# uses it; a target's own fields live in its deploy/<target>/records.py, never on a shared record.
_SHARED_RECORDS = {"Verdict", "Outcome", "Signature", "LoadSummary", "PathEvidence", "RunResult", "RecordError"}
_SECTION_CARRIERS = {"RunResult", "RunManifest", "BuildManifest"}  # records that carry targets' own keys


def _records(path) -> dict[str, list]:
    """The frozen dataclasses of one module: name -> its annotated fields (ast.AnnAssign)."""
    import ast

    found = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.ClassDef) and any(
                isinstance(d, ast.Call) and getattr(d.func, "id", "") == "dataclass"
                and any(k.arg == "frozen" for k in d.keywords) for d in node.decorator_list):
            found[node.name] = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    return found


def _misplaced_records(package) -> list[str]:
    """Records outside their owner: a class in the shared base that not every stage shares, a record
    of ``<stage>/records.py`` no other module of that stage uses, and on a shared record a field of
    a target (typed by a target's record, or named as a field of a target's own section)."""
    import ast

    kv = package / "kvrepro"
    found = []
    base = ast.parse((kv / "records.py").read_text())
    for node in base.body:
        if isinstance(node, ast.ClassDef) and node.name not in _SHARED_RECORDS:
            found.append(f"kvrepro/records.py: {node.name} is not shared by every stage")
    targets = set()  # the targets' record names
    section_keys = set()  # the fields of each target's own section (a record no other of its records holds)
    for path in sorted(kv.glob("deploy/*/records.py")):
        records = _records(path)
        targets |= set(records)
        held = {n.id for fields in records.values() for f in fields for n in ast.walk(f.annotation)
                if isinstance(n, ast.Name)}
        section_keys |= {f.target.id for name, fields in records.items() if name not in held for f in fields}
    for path in [kv / "records.py", *sorted(kv.glob("*/records.py"))]:
        rel = path.relative_to(package).as_posix()
        stage = path.parent
        records = _records(path)
        if path.parent != kv:
            others = " ".join(p.read_text() for p in stage.rglob("*.py") if p != path)
            held = {n.id for fields in records.values() for f in fields for n in ast.walk(f.annotation)
                    if isinstance(n, ast.Name)}
            for name in records:
                if name not in held and not any(f"{sep}{name}{end}" in others for sep in (" ", "(")
                                                for end in (",", "\n", ")")):
                    found.append(f"{rel}: {name} is used by no other module of {stage.name}/")
        for name, fields in records.items():
            for f in fields:
                typed = {n.id for n in ast.walk(f.annotation) if isinstance(n, ast.Name)} | {
                    n.value for n in ast.walk(f.annotation) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
                if typed & targets:
                    found.append(f"{rel}: {name}.{f.target.id} holds a target's record")
                elif name in _SECTION_CARRIERS and f.target.id in section_keys:
                    found.append(f"{rel}: {name}.{f.target.id} is a target's own field")
    return found


def test_records_live_with_their_stage_and_targets_own_their_fields(tmp_path):
    """The check finds a record planted in the shared base, one planted in a stage that does not
    use it, and target fields planted on shared records (a copy; it can fail)."""
    import shutil

    assert _misplaced_records(ROOT) == []
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "kvrepro", copy / "kvrepro", ignore=shutil.ignore_patterns("__pycache__", "data"))
    base = copy / "kvrepro" / "records.py"
    text = base.read_text()
    text += "\n\n@dataclass(frozen=True)\nclass BisectCursor:\n    step: int = 0\n"
    text = text.replace("    retried_after: tuple[str, ...] = ()\n",
                        "    retried_after: tuple[str, ...] = ()\n    node: NodeInfo | None = None\n", 1)
    base.write_text(text)
    builds = copy / "kvrepro" / "builds" / "records.py"
    builds.write_text(builds.read_text().replace("    error_kind: str | None = None\n",
                                                 "    error_kind: str | None = None\n    base_image: str | None = None\n", 1)
                      + "\n\n@dataclass(frozen=True)\nclass SuiteCursor:\n    entry: str = ''\n")
    assert _misplaced_records(copy) == [
        "kvrepro/records.py: BisectCursor is not shared by every stage",
        "kvrepro/records.py: RunResult.node holds a target's record",
        "kvrepro/builds/records.py: SuiteCursor is used by no other module of builds/",
        "kvrepro/builds/records.py: BuildManifest.base_image is a target's own field",
    ]


# --------------------------------------------------------------------------- generated code as data

# a line of Python that defines or imports (what a template of a module holds)
_CODE_LINE = r"^\s*(?:(?:async\s+)?def\s+\w+\s*\(|class\s+\w+\s*[(:]|import\s+[\w.]+|from\s+[\w.]+\s+import\s)"
# a line of a YAML mapping or list of mappings (``key: value``, ``- key: value``)
_YAML_LINE = r"^\s*(?:-\s+)?[A-Za-z_][\w.-]*:(?:\s|$)"
# a program held as a string: (file, the module-level name it is bound to) -> why it is no template
_FIXED_PROGRAMS = {
    ("kvrepro/versions.py", "SERVE_FLAGS_SCRIPT"): "run as is with `python -c` in the runtime env; nothing filled in",
    ("kvrepro/scratch.py", "_JANITOR"): "run as is with `python -I -S -c`; its folder and claims come as argv, nothing filled in",
}
# text that looks like YAML and is not: (file, the f-string's first words) -> why
_NOT_YAML = {
    ("kvrepro/builds/plugin_dist.py", "Metadata-Version:"): "a dist-info METADATA file (email header fields)",
    ("kvrepro/suite/report.py", "expected: "): "a JUnit failure's text, read by a person",
}


def _code_by_string(package) -> list[str]:
    """Where ``package`` (a folder holding kvrepro/) builds Python or YAML as text: an f-string
    whose literal parts (each ``{}`` read as a name) hold a line of Python that defines or imports,
    or two lines of a YAML mapping; or a string holding such Python that is ``.format``-ted,
    ``%``-formatted or ``.replace``-d (directly, or through a module-level name bound to it).
    Also any string (not a docstring) holding two lines of such Python, but a fixed program
    named in _FIXED_PROGRAMS: the fragments of a template edited by find-and-replace are that.
    Docstrings and messages are words, not code: only those shapes count."""
    import ast
    import re

    code, yaml_line = re.compile(_CODE_LINE, re.M), re.compile(_YAML_LINE, re.M)
    found = []
    for rel, tree, docstrings in _modules(package):
        name = rel.as_posix()
        strings = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                   for t in node.targets if isinstance(t, ast.Name)
                   and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}

        bound = {id(node.value): t.id for node in tree.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}

        def text_of(node):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return node.value
            if isinstance(node, ast.Name):
                return strings.get(node.id)
            return None

        for node in ast.walk(tree):
            where = f"{name}:{getattr(node, 'lineno', 0)}"
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and len(code.findall(node.value)) >= 2 and (name, bound.get(id(node))) not in _FIXED_PROGRAMS):
                found.append(f"{where}: Python held in a string")
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "x" for v in node.values)
                if code.search(text):
                    found.append(f"{where}: Python built by an f-string")
                elif "\n" in text and len(yaml_line.findall(text)) >= 2 and not any(
                        name == file and text.startswith(words) for file, words in _NOT_YAML):
                    found.append(f"{where}: YAML built by an f-string")
            template = None
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("format", "replace", "format_map")):
                template = text_of(node.func.value)
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
                template = text_of(node.left)
            if template is not None and (code.search(template) or len(yaml_line.findall(template)) >= 2):
                how = node.func.attr if isinstance(node, ast.Call) else "%"
                found.append(f"{where}: a template of code filled by {how}")
    return found


def test_no_string_template_generates_python_or_yaml(tmp_path):
    """Generated tests and matrices are built as data (ast, the YAML library); the check finds a
    template planted in a copy (it can fail)."""
    assert _code_by_string(ROOT) == []
    repo = _planted(
        tmp_path,
        '"""import os is words in a docstring."""\n\n'
        "_TEMPLATE = '''import json\n\n\ndef test_{name}():\n    assert {value!r}\n'''\n\n\n"
        "def render(name, value):\n    return _TEMPLATE.format(name=name, value=value)\n\n\n"
        "def matrix(base, rate):\n    return f\"base: {base}\\nengine:\\n  rate: {rate}\\n\"\n\n\n"
        "def imports(module, name):\n    return f\"from {module} import {name}\"\n\n\n"
        "_EDITS = [('import json\\nimport random\\n', 'import json\\n')]\n")
    assert _code_by_string(repo) == [
        "kvrepro/minimize/planted.py:12: a template of code filled by format",
        "kvrepro/minimize/planted.py:16: YAML built by an f-string",
        "kvrepro/minimize/planted.py:20: Python built by an f-string",
        "kvrepro/minimize/planted.py:23: Python held in a string",
    ]


# --------------------------------------------------------------------------- the engine log is parsed once

# a function outside classify/ that reads an engine log without the one parser: (file, function) -> why
_OWN_LOG_READERS = {
    ("kvrepro/explore/coverage.py", "run_arcs"):
        "the `kvrepro-arcs:` branch-coverage lines (engine/arcs.py), read by explore alone; not in ParsedLog yet",
    ("kvrepro/release/check.py", "_suite"): "porting.diagnose of an INFRA row's log (the porting step a release "
                                            "needs), a question no verdict asks; not in ParsedLog yet",
    ("kvrepro/release/check.py", "work"): "the same, in _suite's worker",
    ("kvrepro/release/port.py", "run_port"): "porting.diagnose of the first run's log, as release/check.py",
}
_LOG_READS = {"read_text", "read_bytes", "open", "open_log", "open_log_bytes", "readlines", "readline"}
_THE_PARSER = {"parse_log", "LogParser", "LogTail"}


def _second_log_reads(package) -> list[str]:
    """Where ``package`` (a folder holding kvrepro/), outside classify/, reads an engine log itself: a
    function that names it (``"engine.log"``, ``ENGINE_LOG``) and reads a file (``read_text``, ``open``,
    ``open_log``, ...) without handing it to the one parser (``parse_log``, ``LogParser``, ``LogTail``),
    but for the readers _OWN_LOG_READERS names with why. Writing the log (deploy/'s sinks) opens
    nothing to read: those functions do not name a reading call."""
    import ast

    found = []
    for rel, tree, _ in _modules(package):
        if rel.parts[:2] == ("kvrepro", "classify"):
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            names_log = any((isinstance(n, ast.Constant) and isinstance(n.value, str) and "engine.log" in n.value)
                            or (isinstance(n, ast.Name) and n.id == "ENGINE_LOG") for n in ast.walk(fn))
            called = {c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", None)
                      for c in ast.walk(fn) if isinstance(c, ast.Call)}
            if (names_log and called & _LOG_READS and not called & _THE_PARSER
                    and (rel.as_posix(), fn.name) not in _OWN_LOG_READERS):
                found.append(f"{rel.as_posix()}:{fn.lineno}: {fn.name} reads the engine log itself")
    return found


def test_the_engine_log_is_read_through_the_one_parser(tmp_path):
    """minimize/ and triage/ (and every stage but the readers named with why) take what an engine log
    says from classify's parser; the check finds a second reader planted in a copy (it can fail)."""
    assert _second_log_reads(ROOT) == []
    repo = _planted(
        tmp_path,
        "import re\n\n\n"
        "def failed_loads(run_dir):\n"
        "    text = (run_dir / 'engine.log').read_text()\n"
        "    return re.findall(r'kvrepro-fault: load job (\\S+)', text)\n\n\n"
        "def parsed(run_dir):\n"
        "    from ..classify import open_log, parse_log\n"
        "    with open_log(run_dir / 'engine.log') as stream:\n"
        "        return parse_log(stream)\n")
    assert _second_log_reads(repo) == ["kvrepro/minimize/planted.py:4: failed_loads reads the engine "
                                                    "log itself"]
