"""vLLM release source distributions: downloaded once, only their ``tests/`` (and pytest config) kept.

The wheel (kvrepro/builds/wheel.py) has vLLM's code but not its tests; the sdist on the package
index carries ``tests/``. Why not ``pip download --no-binary :all: vllm==X``: pip must build the
sdist's metadata to download it, which for vLLM means installing cmake, ninja and torch from
source as build dependencies (measured 2026-12-02: failed after 4 minutes). So kvrepro asks the
index itself (its JSON Simple API, PEP 691, the one pip reads) for the file's URL and sha256,
downloads it and checks the hash. ``KVREPRO_INDEX_URL`` points at another index.

The cache is checked before it is used (issue 44): the sdist's sha256 is written beside it
(``.sha256``) when the download checked out, and the file is hashed against it again before its
tests are extracted; a cached sdist cut off or changed since (a disk that filled, a copy between
machines) is "damaged cache", removed, exit 3, and the next run fetches it again. A full disk
names the folder it could not write.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..errors import SetupError

INDEX_URL = os.environ.get("KVREPRO_INDEX_URL", "https://pypi.org/simple")
_TIMEOUT_S = 120
# what of the sdist a test run needs: the tests, pytest's settings and the test requirement pins
_KEEP = ("tests/", "pyproject.toml", "requirements/test/cpu.txt")


@dataclass(frozen=True)
class SourceTests:
    """A release's ``tests/`` extracted from its sdist: ``root`` holds ``tests/`` and ``pyproject.toml``."""

    release: str
    root: Path
    sdist_sha256: str

    @property
    def tests(self) -> Path:
        return self.root / "tests"

    def test_pins(self) -> dict[str, str]:
        """name -> version of the release's CPU test requirements (``requirements/test/cpu.txt``)."""
        pins: dict[str, str] = {}
        path = self.root / "requirements" / "test" / "cpu.txt"
        for line in path.read_text().splitlines() if path.exists() else ():
            name, sep, version = line.strip().partition("==")
            if sep and not line.startswith("#"):
                pins[name.strip().lower()] = version.split()[0]
        return pins


def sdists_dir() -> Path:
    return paths.home() / "sdists"


class NotOnIndex(SetupError):
    """The index answered and lists no sdist of the release (as against an index not reached)."""


_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def _cannot_write(folder: Path, exc: OSError) -> SetupError:
    return SetupError(f"{folder}: cannot write the sdist cache: {exc.strerror or exc}; free some space (or point "
                      "$KVREPRO_HOME at a folder with room) and run again")


def _damaged(final: Path, why: str) -> SetupError:
    """A cached sdist that is not what was downloaded: removed (with its sidecar), so that the next
    run fetches it again."""
    for path in (final, final.with_name(final.name + ".sha256")):
        try:
            path.unlink()
        except OSError:
            pass
    return SetupError(f"damaged cache: {final}: {why}; removed it: run the command again to re-fetch it")


def _verified(final: Path) -> str:
    """The cached sdist's sha256, checked against the sidecar written when it was downloaded."""
    sidecar = final.with_name(final.name + ".sha256")
    expected = sidecar.read_text(errors="replace").strip()
    if not re.fullmatch(r"[0-9a-f]{64}", expected):
        raise _damaged(final, f"its sidecar {sidecar.name} holds no sha256")
    digest = hashlib.sha256()
    with open(final, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise _damaged(final, f"sha256 {digest.hexdigest()[:16]}... is not the {expected[:16]}... it was downloaded "
                              "with (cut off or changed since)")
    return expected


def _cached(release: str) -> tuple[Path, str] | None:
    """(the cached sdist, its sha256) when a download of it finished, else None."""
    final = sdists_dir() / release / f"vllm-{release}.tar.gz"
    sidecar = final.with_name(final.name + ".sha256")
    return (final, sidecar.read_text().strip()) if final.exists() and sidecar.exists() else None


def on_index(release: str) -> bool | None:
    """Whether the release's sdist is cached or listed on the index; None when the index cannot be
    read now (so a caller can tell a release that does not exist from a network that is down)."""
    if _cached(release) is not None:
        return True
    try:
        _index_entry(release)
    except NotOnIndex:
        return False
    except SetupError:
        return None
    return True


def _index_entry(release: str) -> tuple[str, str]:
    """(url, sha256) of ``vllm-<release>.tar.gz`` on the index."""
    request = urllib.request.Request(f"{INDEX_URL.rstrip('/')}/vllm/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            files = json.load(response).get("files", [])
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise SetupError(f"cannot read vLLM's file list from the package index {INDEX_URL} ({exc}); "
                         "check that it is reachable or set KVREPRO_INDEX_URL") from None
    wanted = f"vllm-{release}.tar.gz"
    for entry in files:
        if entry.get("filename") == wanted and entry.get("hashes", {}).get("sha256"):
            return entry["url"], entry["hashes"]["sha256"]
    raise NotOnIndex(f"the package index {INDEX_URL} has no source distribution {wanted} with a sha256; "
                     f"check that vLLM {release} exists (`pip index versions vllm`)")


def fetch_sdist(release: str) -> tuple[Path, str]:
    """(the cached ``vllm-<release>.tar.gz``, its sha256), downloaded and hash-checked on first use."""
    cached = _cached(release)
    if cached is not None:
        return cached
    folder = sdists_dir() / release
    final = folder / f"vllm-{release}.tar.gz"
    sidecar = final.with_name(final.name + ".sha256")
    url, expected = _index_entry(release)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".download-", delete=False) as tmp:
        digest = hashlib.sha256()
        try:
            with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
                for chunk in iter(lambda: response.read(1 << 20), b""):
                    digest.update(chunk)
                    tmp.write(chunk)
        except (urllib.error.URLError, OSError) as exc:
            os.unlink(tmp.name)
            if isinstance(exc, OSError) and exc.errno in _SPACE_ERRNOS:
                raise _cannot_write(folder, exc) from None
            raise SetupError(f"downloading {url} failed ({exc}); check that the package index is reachable") from None
        except BaseException:  # a signal mid-download: no half file left in the cache
            os.unlink(tmp.name)
            raise
    if digest.hexdigest() != expected:
        os.unlink(tmp.name)
        raise SetupError(f"{url}: sha256 {digest.hexdigest()} is not the index's {expected}; not used")
    try:
        os.replace(tmp.name, final)
        sidecar.write_text(expected + "\n")
    except OSError as exc:
        raise _cannot_write(folder, exc) from None
    return final, expected


def source_tests(release: str) -> SourceTests:
    """The release's ``tests/`` (extracted once, into a folder named by the sdist's hash)."""
    sdist, digest = fetch_sdist(release)
    root = sdists_dir() / release / f"tests-{digest[:12]}"
    if (root / ".complete").exists():
        return SourceTests(release, root, digest)
    digest = _verified(sdist)  # what is about to be unpacked is what was downloaded
    try:
        tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".extract-"))
    except OSError as exc:
        raise _cannot_write(root.parent, exc) from None
    try:
        prefix = f"vllm-{release}/"
        with tarfile.open(sdist) as tar:
            members = []
            for member in tar.getmembers():
                rel = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and rel.startswith(_KEEP) and (member.isfile() or member.isdir()):
                    member.name = rel
                    members.append(member)
            tar.extractall(tmp, members, filter="data")
        publish_staged(tmp, root, digest)
    except OSError as exc:
        if exc.errno in _SPACE_ERRNOS:
            raise _cannot_write(root.parent, exc) from None
        raise _damaged(sdist, f"cannot be unpacked ({exc})") from None
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise _damaged(sdist, f"cannot be unpacked ({exc})") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return SourceTests(release, root, digest)


def publish_staged(tmp: Path, root: Path, key: str) -> None:
    """Mark a staged cache folder complete (``.complete`` holds its key) and put it in ``root``'s
    place in one rename, so a reader sees the old folder or the whole new one, never half of one."""
    (tmp / ".complete").write_text(key + "\n")
    if root.exists():
        shutil.rmtree(root)
    os.replace(tmp, root)
