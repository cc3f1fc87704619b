"""Apply a build's patch stack to an unpacked vLLM tree, with GNU patch's own semantics.

Why GNU ``patch`` and not a Python re-implementation: the patch files under ``builds/`` are
ordinary unified diffs that a person also applies by hand (``patch -p1 < builds/pr-52807.patch``);
the tool must agree with that, byte for byte, so it runs the same program.

Fuzz policy (reproducibility, the same contract as ``git apply``): a hunk may land at an
*offset* (other hunks of the stack moved its lines), but every context line must match exactly
(``--fuzz=0``, no whitespace folding). A patch that only applies with fuzz is a patch written
against different code, and applying it anyway would build something nobody reviewed.

Each patch is first tried with ``--dry-run``; only if every hunk would apply is it applied for
real (and the touched files are restored if that real run still fails), so a failing patch
leaves the tree exactly as the previous patch of the stack left it. No backup (``.orig``) and
no reject (``.rej``) files are ever written into the tree.

A patch declared ``reverse: true`` (matrix.yaml) is applied with ``patch --reverse``: the build
*reverts* the upstream change the file holds (a fix every supported release already carries, so
that the defect it removed can be shown present on the revert and absent on the release). The
same rules hold in reverse: exact context, dry run first, and a tree that does not carry the
change ("Unreversed patch detected") is a failure, never silently skipped.

The header format of the patch files (``# Upstream:``, ``# Expect:`` ...) is documented in
``builds/README.md``; :func:`read_header` parses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import InfraError, SetupError, SpecError
from .records import PatchFailure
from ..spec.records import PatchRef

#: Path components stripped from the names in the diff (``a/vllm/...`` -> ``vllm/...``).
STRIP = 1
#: Context lines a hunk may ignore. 0: offsets are fine, inexact context is not.
FUZZ = 0

_PATCH_TIMEOUT_S = 120
_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_HEADER_FIELD_RE = re.compile(r"^#\s*([A-Za-z][A-Za-z-]*):\s*(.*?)\s*$")
_EXPECT_RE = re.compile(r'^(?P<file>\S+)\s+(?P<verb>contains|lacks)\s+(?P<text>".*")$')
_DERIVED_RE = re.compile(r"^vllm\s+(?P<release>\d+\.\d+\.\d+\S*)\s+(?P<file>[^\s(]+)(?:\s+\((?P<note>.*)\))?$")
_UPSTREAM_TEST_RE = re.compile(r"^vllm\s+(?P<release>\d+\.\d+\.\d+\S*)\s+(?P<nodeid>tests/\S+\.py::\S+)$")
_KNOWN_FIELDS = ("Upstream", "Title", "Base", "Requires", "Derived-From", "Expect", "Upstream-Test")


# --------------------------------------------------------------------------- header


@dataclass(frozen=True)
class Expectation:
    """One ``# Expect: <file> contains|lacks "<text>"`` claim of a patch header.

    It is a claim about the tree *after* the patch; the tree *before* it must make the
    opposite claim true, otherwise the patch did not change what it says it changes.
    """

    file: str
    present: bool  # True for `contains`, False for `lacks`
    text: str
    line: int  # line of the claim in the patch file, for error messages

    def holds(self, root: Path) -> bool:
        """Whether the claim is true of the tree at ``root`` (a missing file contains nothing)."""
        path = root / self.file
        found = path.is_file() and self.text in path.read_text(encoding="utf-8", errors="replace")
        return found == self.present

    def describe(self) -> str:
        return f"{self.file} {'contains' if self.present else 'lacks'} {json.dumps(self.text)}"


@dataclass(frozen=True)
class DerivedFrom:
    """One ``# Derived-From: vllm <release> <file> (<what>)`` line: the upstream release tree a
    backport's hunks for ``file`` were taken from (provenance; ``note`` says which parts)."""

    release: str
    file: str
    note: str
    line: int

    def describe(self) -> str:
        return f"vllm {self.release} {self.file}" + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class UpstreamTest:
    """One ``# Upstream-Test: vllm <release> <tests/...py::test>`` line: a regression test that came
    with the upstream fix, in the release whose ``tests/`` carries it (``kvrepro builds test``)."""

    release: str
    nodeid: str
    line: int


@dataclass(frozen=True)
class PatchHeader:
    """What a patch file says about itself, before its diff starts."""

    upstream: str
    title: str
    description: str
    expects: tuple[Expectation, ...]
    base: str | None = None
    requires: tuple[str, ...] = field(default=())
    derived_from: tuple[DerivedFrom, ...] = field(default=())
    upstream_tests: tuple[UpstreamTest, ...] = field(default=())


def read_header(patch_path: Path) -> PatchHeader:
    """Parse the ``#`` lines that precede the diff of ``patch_path``.

    Raises SpecError naming ``file:line`` for a header a person has to fix: a missing
    ``Upstream``/``Title``, an unknown field in the field block (a typo such as ``Expects:``
    would otherwise silently drop a claim), a malformed ``Expect`` line, or a non-``#`` line
    before the diff.
    """
    patch_path = Path(patch_path)
    lines = _read_text(patch_path).splitlines()
    fields: dict[str, str] = {}
    expects: list[Expectation] = []
    requires: list[str] = []
    derived: list[DerivedFrom] = []
    upstream_tests: list[UpstreamTest] = []
    description: list[str] = []
    in_fields = True
    for number, line in enumerate(lines, start=1):
        if _starts_diff(lines, number - 1):
            break
        where = f"{patch_path}:{number}"
        if not line.strip():
            in_fields = False
            continue
        if not line.startswith("#"):
            raise SpecError(
                f"{where}: header lines must start with '#' (found {line[:40]!r}); "
                "put free text after a '#' and start the diff with '--- a/...'"
            )
        match = _HEADER_FIELD_RE.match(line) if in_fields else None
        if in_fields and match is None:
            if line.strip("# \t"):
                raise SpecError(
                    f"{where}: expected a field line '# Key: value' ({', '.join(_KNOWN_FIELDS)}) "
                    "or a bare '#' line that ends the field block"
                )
            in_fields = False
            continue
        if match is None:
            description.append(line[1:].removeprefix(" "))
            continue
        key, value = match.group(1), match.group(2)
        if key not in _KNOWN_FIELDS:
            raise SpecError(f"{where}: unknown header field {key!r}; allowed: {', '.join(_KNOWN_FIELDS)}")
        if key == "Expect":
            expects.append(_parse_expect(value, where, number))
        elif key == "Derived-From":
            derived.append(_parse_derived(value, where, number))
        elif key == "Upstream-Test":
            upstream_tests.append(_parse_upstream_test(value, where, number))
        elif key == "Requires":
            requires.extend(name for name in re.split(r"[,\s]+", value) if name)
        elif key in fields:
            raise SpecError(f"{where}: header field {key!r} given twice")
        else:
            fields[key] = value
    for required in ("Upstream", "Title"):
        if not fields.get(required):
            raise SpecError(f"{patch_path}: header has no '# {required}: ...' line; see builds/README.md")
    return PatchHeader(
        upstream=fields["Upstream"],
        title=fields["Title"],
        description="\n".join(description).strip(),
        expects=tuple(expects),
        base=fields.get("Base"),
        requires=tuple(requires),
        derived_from=tuple(derived),
        upstream_tests=tuple(upstream_tests),
    )


def _parse_upstream_test(value: str, where: str, number: int) -> UpstreamTest:
    match = _UPSTREAM_TEST_RE.match(value)
    if match is None or not _safe_relative(match.group("nodeid").split("::")[0]):
        raise SpecError(f"{where}: Upstream-Test must read `vllm <release> tests/<file>.py::<test>`, e.g. "
                        f"`vllm 0.30.0 tests/v1/core/test_scheduler.py::test_x`; got {value!r}")
    return UpstreamTest(release=match.group("release"), nodeid=match.group("nodeid"), line=number)


def _parse_derived(value: str, where: str, number: int) -> DerivedFrom:
    match = _DERIVED_RE.match(value)
    if match is None:
        raise SpecError(f"{where}: Derived-From must read `vllm <release> <relative file> (<what>)`, "
                        f"e.g. `vllm 0.27.0 vllm/v1/core/kv_cache_manager.py (get_computed_blocks_for_connector)`; "
                        f"got {value!r}")
    file = match.group("file")
    if not _safe_relative(file):
        raise SpecError(f"{where}: Derived-From file {file!r} must be a relative path inside the tree")
    return DerivedFrom(release=match.group("release"), file=file, note=(match.group("note") or "").strip(),
                       line=number)


def _parse_expect(value: str, where: str, number: int) -> Expectation:
    match = _EXPECT_RE.match(value)
    if match is None:
        raise SpecError(f'{where}: Expect must read `<relative file> contains|lacks "<text>"`, got {value!r}')
    try:
        text = json.loads(match.group("text"))
    except json.JSONDecodeError as exc:
        raise SpecError(f"{where}: Expect text is not a valid double-quoted string: {exc.msg}") from None
    if not text:
        raise SpecError(f"{where}: Expect text is empty; a claim about \"\" is always true")
    file = match.group("file")
    if not _safe_relative(file):
        raise SpecError(f"{where}: Expect file {file!r} must be a relative path inside the tree")
    return Expectation(file=file, present=match.group("verb") == "contains", text=text, line=number)


# --------------------------------------------------------------------------- diff parsing


@dataclass(frozen=True)
class _Hunk:
    header: str  # "@@ -777,40 +777,41 @@"
    line: int  # line of the header in the patch file


@dataclass(frozen=True)
class _FileDiff:
    path: str  # relative path after stripping STRIP components
    creates: bool
    deletes: bool
    hunks: tuple[_Hunk, ...]


class _Malformed(Exception):
    def __init__(self, line: int, message: str, path: str = "", hunk: str = ""):
        super().__init__(message)
        self.line, self.message, self.path, self.hunk = line, message, path, hunk


def _starts_diff(lines: list[str], i: int) -> bool:
    line = lines[i]
    if line.startswith(("diff ", "Index: ")):
        return True
    return line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")


def _strip_path(raw: str, line: int) -> str | None:
    name = raw.split("\t", 1)[0].strip()
    if name.startswith('"') and name.endswith('"'):
        try:
            name = json.loads(name)
        except json.JSONDecodeError:
            raise _Malformed(line, f"cannot read quoted file name {name}") from None
    if name == "/dev/null":
        return None
    parts = PurePosixPath(name).parts
    if len(parts) <= STRIP:
        raise _Malformed(line, f"file name {name!r} has no component left after stripping {STRIP} (-p{STRIP})")
    stripped = "/".join(parts[STRIP:])
    if not _safe_relative(stripped):
        raise _Malformed(line, f"file name {name!r} points outside the tree")
    return stripped


def _safe_relative(path: str) -> bool:
    pure = PurePosixPath(path)
    return bool(path) and not pure.is_absolute() and ".." not in pure.parts


def _parse_diff(text: str) -> list[_FileDiff]:
    """The file sections and hunks of a unified diff; text outside them is ignored, as patch does."""
    lines = text.splitlines()
    files: list[_FileDiff] = []
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        old = _strip_path(lines[i][4:], i + 1)
        new = _strip_path(lines[i + 1][4:], i + 2)
        if old is None and new is None:
            raise _Malformed(i + 1, "both sides of the file header are /dev/null")
        path = new if new is not None else old
        assert path is not None
        i += 2
        hunks: list[_Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            match = _HUNK_RE.match(lines[i])
            if match is None:
                raise _Malformed(i + 1, f"unreadable hunk header {lines[i]!r}", path)
            header = match.group(0)
            hunk_line = i + 1
            old_left = int(match.group(2) if match.group(2) is not None else 1)
            new_left = int(match.group(4) if match.group(4) is not None else 1)
            i += 1
            while old_left > 0 or new_left > 0:
                if i >= len(lines):
                    raise _Malformed(hunk_line, "the patch ends inside this hunk", path, header)
                body = lines[i]
                tag = body[:1]
                if tag == " " or body == "":  # some tools drop the blank of an empty context line
                    old_left, new_left = old_left - 1, new_left - 1
                elif tag == "-":
                    old_left -= 1
                elif tag == "+":
                    new_left -= 1
                elif tag != "\\":
                    raise _Malformed(
                        i + 1,
                        f"line {body[:40]!r} inside the hunk is neither context, '-' nor '+'; "
                        "the @@ line counts do not match the hunk body",
                        path,
                        header,
                    )
                if old_left < 0 or new_left < 0:
                    raise _Malformed(hunk_line, "the hunk body is longer than its @@ line says", path, header)
                i += 1
            while i < len(lines) and lines[i].startswith("\\"):
                i += 1
            hunks.append(_Hunk(header=header, line=hunk_line))
        if not hunks:
            raise _Malformed(i, "file header without any @@ hunk", path)
        files.append(_FileDiff(path=path, creates=old is None, deletes=new is None, hunks=tuple(hunks)))
    return files


def _hunk_label(diff: _FileDiff, number: int) -> str:
    if 1 <= number <= len(diff.hunks):
        return f"#{number} ({diff.hunks[number - 1].header})"
    return f"#{number}"


def touched_files(patch_path: Path) -> list[str]:
    """Relative paths (``vllm/...``) the patch creates, modifies or deletes, in diff order.

    Raises SpecError naming ``file:line`` if the patch cannot be read as a unified diff.
    """
    patch_path = Path(patch_path)
    try:
        diffs = _parse_diff(_read_text(patch_path))
    except _Malformed as exc:
        raise SpecError(f"{patch_path}:{exc.line}: malformed patch: {exc.message}") from None
    if not diffs:
        raise SpecError(f"{patch_path}: no unified diff found (expected '--- a/...' / '+++ b/...' and '@@' hunks)")
    return list(dict.fromkeys(d.path for d in diffs))


def _read_text(patch_path: Path) -> str:
    try:
        return patch_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{patch_path}: no such patch file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{patch_path}: cannot read the patch file: {exc}") from None


# --------------------------------------------------------------------------- applying


def _patch_program() -> str:
    program = shutil.which("patch")
    if program is None:
        raise SetupError("GNU patch is not installed (needed to apply builds/*.patch): run `apt-get install patch`")
    return program


def _run_patch(program: str, root: Path, data: bytes, dry_run: bool, reverse: bool = False) -> tuple[int, str]:
    args = [
        program,
        f"-p{STRIP}",
        # an already-applied patch (with --reverse: a change the tree lacks) is a failure, never
        # silently applied the other way round
        "--forward",
        "--batch",
        f"--fuzz={FUZZ}",
        "--no-backup-if-mismatch",
        "--reject-file=-",  # '-' discards rejects: no .rej in the tree
        "--get=0",
        "--quoting-style=literal",
        "--directory",
        str(root),
    ]
    if dry_run:
        args.append("--dry-run")
    if reverse:
        args.append("--reverse")
    # patch's messages are parsed below, so they must be the untranslated ones; its
    # environment knobs (backup suffixes, POSIX mode, RCS checkout) must not change semantics.
    env = {k: v for k, v in os.environ.items()
           if k not in ("POSIXLY_CORRECT", "QUOTING_STYLE", "PATCH_GET", "PATCH_VERSION_CONTROL",
                        "VERSION_CONTROL", "SIMPLE_BACKUP_SUFFIX")}
    env.update(LC_ALL="C", LANG="C", LANGUAGE="C")
    try:
        proc = subprocess.run(args, input=data, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, timeout=_PATCH_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"patch did not finish within {_PATCH_TIMEOUT_S}s"
    return proc.returncode, proc.stdout.decode("utf-8", errors="replace")


# what GNU patch says when a whole patch is refused, and what that means for the stack
_WHOLE_PATCH_REFUSALS = (
    ("Reversed (or previously applied) patch detected",
     "the change is already in the tree: is the patch listed twice in the stack, or already part of this "
     "base version?"),
    ("Unreversed patch detected",
     "the tree does not carry the change this revert takes out: is this base older than the upstream fix, "
     "or is the revert listed twice in the stack?"),
)


def _failure_from_output(name: str, diffs: list[_FileDiff], output: str) -> PatchFailure:
    """Name the file and hunk that patch's own messages blame (the first one, in order)."""
    by_path = {d.path: d for d in diffs}
    sections = iter(diffs)
    current: _FileDiff | None = None
    words = [line.strip() for line in output.splitlines() if line.strip()]
    for line in words:
        for prefix in ("checking file ", "patching file "):
            if line.startswith(prefix):
                path = line[len(prefix):]
                current = next(sections, None)
                if current is None or current.path != path:
                    current = by_path.get(path, current)
        failed = re.match(r"Hunk #(\d+) FAILED at (\d+)", line)
        if failed:
            file = current.path if current else "(unknown file)"
            hunk = _hunk_label(current, int(failed.group(1))) if current else f"#{failed.group(1)}"
            summary = [w for w in words if "FAILED" in w and (w.startswith("Hunk #") or "out of" in w)]
            return PatchFailure(
                patch=name, file=file, hunk=hunk,
                detail="; ".join(summary) + f" (context must match exactly: fuzz {FUZZ}, offsets allowed)",
            )
        for start, why in _WHOLE_PATCH_REFUSALS:
            if line.startswith(start):
                return PatchFailure(patch=name, file=current.path if current else "(unknown file)",
                                    hunk=_hunk_label(current, 1) if current else "#1", detail=f"{line} -- {why}")
        if line.startswith("can't find file to patch"):
            file = current.path if current else "(unknown file)"
            return PatchFailure(patch=name, file=file, hunk=_hunk_label(current, 1) if current else "#1",
                                detail=f"{line}: the file does not exist in the tree")
        if line.startswith("patch: ****"):  # fatal: malformed input, unreadable file, ...
            return PatchFailure(patch=name, file=current.path if current else "(patch file)",
                                hunk="(whole patch)", detail=line.removeprefix("patch: **** "))
    return PatchFailure(patch=name, file=current.path if current else "(unknown file)", hunk="(unknown hunk)",
                        detail=" | ".join(words) or "patch failed without saying why")


def _components(root: Path, rel: str) -> list[Path]:
    """root/a, root/a/b, ... root/rel: every path patch walks through to reach the file."""
    parts = PurePosixPath(rel).parts
    return [root.joinpath(*parts[: i + 1]) for i in range(len(parts))]


def _missing_requirements(ref: PatchRef, applied: Sequence[str]) -> list[str]:
    """Patches the header says must come first but that are not earlier in this stack."""
    try:
        header = read_header(Path(ref.path))
    except SpecError:
        return []  # a hint only; the hunk failure is the finding
    return [name for name in header.requires if name not in applied]


def _apply_one(program: str, root: Path, ref: PatchRef, applied: Sequence[str]) -> PatchFailure | None:
    def fail(file: str, hunk: str, detail: str) -> PatchFailure:
        return PatchFailure(patch=ref.label, file=file, hunk=hunk, detail=detail)

    try:
        data = Path(ref.path).read_bytes()
    except OSError as exc:
        return fail("(patch file)", "(whole patch)", f"cannot read {ref.path}: {exc.strerror or exc}")
    digest = hashlib.sha256(data).hexdigest()
    if ref.sha256 and digest != ref.sha256:
        return fail("(patch file)", "(whole patch)",
                    f"{ref.path} has sha256 {digest} but the build plan pinned {ref.sha256}; "
                    "the file changed after the matrix was loaded")
    try:
        diffs = _parse_diff(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return fail("(patch file)", "(whole patch)", f"{ref.path} is not UTF-8 text: {exc}")
    except _Malformed as exc:
        hunk = "(whole patch)"
        if exc.hunk:
            hunk = f"({exc.hunk})"
        return fail(exc.path or "(patch file)", hunk, f"malformed patch at {ref.path}:{exc.line}: {exc.message}")
    if not diffs:
        return fail("(patch file)", "(whole patch)",
                    f"{ref.path} holds no unified diff ('--- a/...', '+++ b/...', '@@' hunks)")
    for diff in diffs:
        target = root / diff.path
        link = next((p for p in _components(root, diff.path) if p.is_symlink()), None)
        if link is not None:
            return fail(diff.path, _hunk_label(diff, 1),
                        f"{link} is a symbolic link; patch refuses to write through links (that "
                        "protects the tree they point to): copy the files touched_files() names, "
                        "and their folders, into the tree as real files first")
        if not diff.creates and not target.is_file():
            return fail(diff.path, _hunk_label(diff, 1),
                        f"the file does not exist under {root}; is this the right vLLM version, "
                        f"and are paths in the diff 'a/vllm/...' (stripped with -p{STRIP})?")

    def explain(output: str) -> PatchFailure:
        failure = _failure_from_output(ref.label, diffs, output)
        missing = _missing_requirements(ref, applied)
        if missing:
            failure = dataclasses.replace(
                failure,
                detail=f"{failure.detail}; its header says it requires {', '.join(missing)}, "
                       "which is not earlier in this stack",
            )
        return failure

    code, output = _run_patch(program, root, data, dry_run=True, reverse=ref.reverse)
    if code != 0:
        return explain(output)

    # The dry run said yes; keep the bytes anyway so that a real run failing for another
    # reason (disk full, permissions) still leaves the tree as the previous patch left it.
    saved = {d.path: ((root / d.path).read_bytes() if (root / d.path).is_file() else None) for d in diffs}
    code, output = _run_patch(program, root, data, dry_run=False, reverse=ref.reverse)
    if code != 0:
        for rel, content in saved.items():
            if content is None:
                (root / rel).unlink(missing_ok=True)
            else:
                (root / rel).write_bytes(content)
        return explain(output)
    return None


def apply_patch_stack(root: Path, patches: Sequence[PatchRef]) -> PatchFailure | None:
    """Apply ``patches`` in order, in place, to the tree at ``root`` (the folder holding ``vllm/``).

    Returns None when every patch applied, else the PatchFailure of the first patch that did
    not; the patches before it stay applied, and the failing one changed nothing. Problems of
    a patch (hunk does not match, file missing, already applied, malformed, sha256 changed)
    are returned, never raised. Raises SetupError if GNU patch is not installed and
    InfraError if ``root`` is not a directory.
    """
    program = _patch_program()
    root = Path(root)
    if not root.is_dir():
        raise InfraError(f"cannot patch {root}: not a directory (expected the folder that holds vllm/)")
    applied: list[str] = []
    for ref in patches:
        failure = _apply_one(program, root, ref, applied)
        if failure is not None:
            return failure
        applied.append(ref.name)
    return None


def check_expectations(root: Path, header: PatchHeader) -> list[str]:
    """The header's claims that are false of the tree at ``root`` (empty: all hold)."""
    return [f"line {e.line}: {e.describe()}" for e in header.expects if not e.holds(Path(root))]
