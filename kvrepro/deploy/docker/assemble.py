"""Image assembly: a base vLLM image + a build's patch stack + the probe -> a tagged image.

The base image is the ground truth (it is what production runs), so nothing is rebuilt from
source: a throwaway container finds the ``vllm`` package in the base and exports its Python
sources once per base; the build's patches are applied on the host with the same code as the
GPU-free builds (``kvrepro.builds.patching``); the new image is ``FROM <base>`` plus only the
patched files and the probe. Its tag is a hash of the inputs, so identical inputs reuse it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import docker.errors
import requests

from ... import paths
from ...builds import patching
from ...errors import KvreproError
from ...spec.records import BuildPlan
from . import labels as L
from .errors import ImageBuildError, ImageMissingError
from .hosts import DockerHost, remove_quietly

ASSEMBLY_FORMAT = 2
PROBE_SOURCE = paths.PACKAGE_ROOT / "probe" / "kvrepro_probe.py"
PROBE_PTH = "import kvrepro_probe\n"
LOCATE_SCRIPT = paths.PACKAGE_ROOT / "data" / "docker" / "locate_vllm.py"
IMAGE_REPO = "kvrepro/vllm"

OnLine = Callable[[str], None]


def _quiet(line: str) -> None:
    pass


def docker_dir() -> Path:
    return paths.home() / "docker"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def probe_sha256() -> str:
    return sha256_bytes(PROBE_SOURCE.read_bytes())


@dataclass(frozen=True)
class BaseInfo:
    """A base image as found on one host."""

    ref: str            # as matrix.yaml names it
    image_id: str       # sha256:... of the image config: the same on every host for the same image
    digest: str         # the registry digest (sha256:...) when the image came from a registry, else image_id
    digest_source: str  # "registry" | "image-id"


@dataclass(frozen=True)
class Assembly:
    tag: str
    image_id: str
    key: str
    reused: bool
    manifest: dict[str, Any]
    labels: dict[str, str]
    source_root: Path | None
    seconds: float


def safe_tag_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:80]


def image_tag(base_version: str, key: str) -> str:
    return f"{IMAGE_REPO}:{safe_tag_part(base_version)}-{key[:12]}"


def find_base(host: DockerHost, ref: str, pull: bool, on_line: OnLine = _quiet) -> BaseInfo:
    """The base image on ``host``; pulled when absent (and allowed), else ImageMissingError."""
    client = host.client
    try:
        image = client.images.get(ref)
    except docker.errors.ImageNotFound:
        if not pull:
            raise ImageMissingError(
                f"host {host.name}: base image {ref} is not present and docker.pull is false; "
                f"`docker pull {ref}` on that host (or `kvrepro images base-cpu` for the CPU base)"
            ) from None
        on_line(f"{host.name}: pulling {ref}")
        try:
            image = client.images.pull(ref)
        except (docker.errors.APIError, docker.errors.ImageNotFound, requests.RequestException) as exc:
            reason = getattr(exc, "explanation", None) or str(exc)
            raise ImageMissingError(
                f"host {host.name}: base image {ref} is not present and pulling it failed ({str(reason)[:300]}); "
                f"pull or load it on that host, or for tests and laptops build the CPU base with "
                f"`kvrepro images base-cpu` and set base_image: to its tag"
            ) from None
    repo = ref.split("@")[0]
    repo = repo.rsplit(":", 1)[0] if ":" in repo.rsplit("/", 1)[-1] else repo
    digests = image.attrs.get("RepoDigests") or []
    match = next((d for d in digests if d.split("@")[0] == repo), digests[0] if digests else None)
    if match:
        return BaseInfo(ref=ref, image_id=image.id, digest=match.split("@", 1)[1], digest_source="registry")
    return BaseInfo(ref=ref, image_id=image.id, digest=image.id, digest_source="image-id")


def _run_throwaway(host: DockerHost, image: str, argv: list[str], step: str, files: dict[str, bytes] | None = None,
                   fetch: str | None = None) -> tuple[str, bytes | None]:
    """Run ``argv`` in a labelled throwaway container; return its output (and a file it wrote)."""
    client = host.client
    container = None
    try:
        container = client.containers.create(
            image, entrypoint=argv[:1], command=argv[1:], network_disabled=True, detach=True,
            labels=L.managed("probe"), name=f"kvrepro-probe-{L.SESSION}-{os.urandom(3).hex()}",
        )
        if files:
            container.put_archive("/", _tar_of(files))
        container.start()
        status = container.wait(timeout=300)
        output = container.logs(stdout=True, stderr=True).decode("utf-8", "replace")
        if status.get("StatusCode") != 0:
            raise ImageBuildError(f"step '{step}' failed in {image} (exit {status.get('StatusCode')}):\n"
                                  + "\n".join(output.strip().splitlines()[-10:]))
        blob = None
        if fetch:
            stream, _ = container.get_archive(fetch)
            outer = tarfile.open(fileobj=io.BytesIO(b"".join(stream)))
            member = outer.next()
            blob = outer.extractfile(member).read() if member is not None else None
        return output, blob
    except (docker.errors.APIError, requests.RequestException) as exc:
        raise ImageBuildError(f"step '{step}' on host {host.name}: {getattr(exc, 'explanation', None) or exc}") from None
    finally:
        if container is not None:
            remove_quietly(container)


def _tar_of(files: dict[str, bytes], mode: int = 0o644) -> bytes:
    buf = io.BytesIO()
    now = int(time.time())
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name.lstrip("/"))
            info.size = len(data)
            info.mode = mode
            info.mtime = now
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def base_sources(host: DockerHost, base: BaseInfo, on_line: OnLine = _quiet) -> tuple[dict[str, Any], Path]:
    """(facts about the base's vllm, a host folder holding its ``vllm/`` Python sources).

    Cached per base image id: exporting ~2000 files takes seconds, reading the cache none.
    """
    folder = docker_dir() / "bases" / base.image_id.split(":")[-1][:16]
    info_path = folder / "base.json"
    if info_path.is_file() and (folder / "vllm" / "__init__.py").is_file():
        return json.loads(info_path.read_text()), folder
    on_line(f"{host.name}: locating vllm in {base.ref} and exporting its sources")
    script = LOCATE_SCRIPT.read_bytes()
    output, blob = _run_throwaway(
        host, base.image_id, ["python3", "/tmp/kvrepro_locate_vllm.py", "/tmp/kvrepro-vllm-src.tar"],
        "locate vllm in the base image", files={"tmp/kvrepro_locate_vllm.py": script},
        fetch="/tmp/kvrepro-vllm-src.tar",
    )
    facts = _last_json(output)
    if facts is None or "site_dir" not in facts or blob is None:
        raise ImageBuildError(f"step 'locate vllm in the base image': {base.ref} gave no answer:\n{output[-1500:]}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            tar.extractall(tmp, filter="data")
        facts.update(base_ref=base.ref, base_image_id=base.image_id, base_digest=base.digest)
        (tmp / "base.json").write_text(json.dumps(facts, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return facts, folder


def _last_json(output: str) -> dict[str, Any] | None:
    for line in reversed(output.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _fetch_files(host: DockerHost, image_id: str, site_dir: str, rels: list[str]) -> dict[str, bytes]:
    """Files of the base image (by path relative to its site dir) that are not in the cache."""
    if not rels:
        return {}
    found: dict[str, bytes] = {}
    container = host.client.containers.create(image_id, entrypoint=["true"], labels=L.managed("probe"),
                                              network_disabled=True)
    try:
        for rel in rels:
            try:
                stream, _ = container.get_archive(str(PurePosixPath(site_dir) / rel))
            except docker.errors.NotFound:
                continue  # a file the patch creates
            tar = tarfile.open(fileobj=io.BytesIO(b"".join(stream)))
            member = tar.next()
            if member is not None and member.isfile():
                found[rel] = tar.extractfile(member).read()
    finally:
        remove_quietly(container)
    return found


def assembly_key(base: BaseInfo, plan: BuildPlan) -> str:
    """What the image's content depends on; its first 12 hex digits name the tag."""
    material = {
        "format": ASSEMBLY_FORMAT,
        "base_image_id": base.image_id,
        "patches": [[p.name, p.sha256, *(["reverse"] if p.reverse else [])] for p in plan.patches],
        "probe_sha256": probe_sha256(),
        "probe_pth": PROBE_PTH,
    }
    return sha256_bytes(json.dumps(material, sort_keys=True).encode())


def _existing(host: DockerHost, tag: str, key: str):
    try:
        image = host.client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    if (image.labels or {}).get(L.LABEL_KEY) != key:
        return None  # a tag we did not make, or a hash prefix collision: build afresh
    return image


def _patched_tree(plan: BuildPlan, key: str, facts: dict[str, Any], pristine: Path, host: DockerHost,
                  base: BaseInfo, on_line: OnLine) -> tuple[Path, list[str], dict[str, dict[str, str | None]]]:
    """The base's sources with the plan's patches applied, at a folder that also serves as
    the classifier's source root. Returns (folder, touched paths, per-file before/after sha256)."""
    dest = docker_dir() / "builds" / key[:16]
    touched: list[str] = []
    for patch in plan.patches:
        try:
            touched += patching.touched_files(patch.path)
        except KvreproError as exc:
            raise ImageBuildError(f"build {plan.name}: step 'read patch {patch.name}': {exc}") from None
    touched = list(dict.fromkeys(touched))
    done = dest / "files.json"
    if done.is_file() and (dest / "vllm").is_dir():
        return dest, touched, json.loads(done.read_text())

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    try:
        shutil.copytree(pristine / "vllm", tmp / "vllm", copy_function=os.link)
        missing = [rel for rel in touched if not (tmp / rel).is_file()]
        for rel, data in _fetch_files(host, base.image_id, facts["site_dir"], missing).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        before: dict[str, str | None] = {}
        for rel in touched:
            path = tmp / rel
            if path.is_file():
                data = path.read_bytes()
                before[rel] = sha256_bytes(data)
                path.unlink()  # a private copy: patch must not write through the hard link
                path.write_bytes(data)
            else:
                before[rel] = None
        if plan.patches:
            on_line(f"build {plan.name}: applying {' + '.join(p.name for p in plan.patches)}")
        try:
            failure = patching.apply_patch_stack(tmp, plan.patches)
        except KvreproError as exc:
            raise ImageBuildError(f"build {plan.name}: step 'apply patches': {exc}") from None
        if failure is not None:
            raise ImageBuildError(f"build {plan.name}: step 'apply patch {failure.patch}': {failure}")
        files = {
            rel: {"before": before[rel],
                  "after": sha256_bytes((tmp / rel).read_bytes()) if (tmp / rel).is_file() else None}
            for rel in touched
        }
        (tmp / "files.json").write_text(json.dumps(files, indent=2) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        return dest, touched, files
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _context(base: BaseInfo, tree: Path, touched: list[str], files: dict[str, dict[str, str | None]],
             install_dir: str, labels: dict[str, str]) -> bytes:
    """The build context: a Dockerfile and the files it adds, as an in-memory tar."""
    members: dict[str, bytes] = {}
    removed: list[str] = []
    for rel in touched:
        target = str(PurePosixPath(install_dir) / rel)
        if files[rel]["after"] is None:
            removed.append(target)
        else:
            members["overlay" + target] = (tree / rel).read_bytes()
    members["overlay" + str(PurePosixPath(install_dir) / "kvrepro_probe.py")] = PROBE_SOURCE.read_bytes()
    members["overlay" + str(PurePosixPath(install_dir) / "kvrepro_probe.pth")] = PROBE_PTH.encode()
    lines = [f"FROM {base.image_id}", "COPY overlay/ /"]
    if removed:
        lines.append("RUN " + json.dumps(["rm", "-f", *removed]))
    # One LABEL instruction rather than the API's labels parameter, which the classic builder
    # turns into one step (and one intermediate container) per label.
    lines.append("LABEL " + " ".join(f"{_label_word(k)}={_label_word(v)}" for k, v in sorted(labels.items())))
    members["Dockerfile"] = ("\n".join(lines) + "\n").encode()
    return _tar_of(members)


def _label_word(text: str) -> str:
    """A Dockerfile word that reads back as exactly ``text`` (quotes, backslashes and the
    ``$`` of variable substitution escaped; newlines cannot occur in our JSON)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace("\n", " ")
    return f'"{escaped}"'



def assemble(host: DockerHost, base_ref: str, plan: BuildPlan, *, pull: bool = True,
             on_line: OnLine = _quiet) -> Assembly:
    """Build (or reuse) the image for ``plan`` on ``host``. Raises ImageMissingError/ImageBuildError."""
    started = time.monotonic()
    base = find_base(host, base_ref, pull, on_line)
    key = assembly_key(base, plan)
    tag = image_tag(plan.base, key)
    existing = _existing(host, tag, key)
    if existing is not None:
        manifest = json.loads(existing.labels.get(L.LABEL_MANIFEST, "{}"))
        tree: Path | None = docker_dir() / "builds" / key[:16]
        if not (tree / "files.json").is_file():
            # The image outlived this machine's cache (or came from another one): the sources
            # only serve the classifier, so rebuild them if we can and go on without if not.
            try:
                facts, pristine = base_sources(host, base, on_line)
                tree = _patched_tree(plan, key, facts, pristine, host, base, on_line)[0]
            except KvreproError:
                tree = None
        return Assembly(tag=tag, image_id=existing.id, key=key, reused=True, manifest=manifest,
                        labels=dict(existing.labels), seconds=time.monotonic() - started, source_root=tree)

    facts, pristine = base_sources(host, base, on_line)
    install_dir = facts["site_dir"] if facts.get("site_dir_is_site", True) else facts["purelib"]
    tree, touched, files = _patched_tree(plan, key, facts, pristine, host, base, on_line)
    manifest = {
        "format": ASSEMBLY_FORMAT,
        "key": key,
        "tag": tag,
        "base": plan.base,
        "base_image": base.ref,
        "base_image_id": base.image_id,
        "base_digest": base.digest,
        "base_digest_source": base.digest_source,
        "vllm_version_in_base": facts.get("vllm_version"),
        "python_in_base": facts.get("python_version"),
        "site_dir": facts["site_dir"],
        "patches": [{"name": p.name, "upstream": p.upstream, "sha256": p.sha256,
                     **({"reverse": True} if p.reverse else {})} for p in plan.patches],
        "files": files,
        "probe": {"path": str(PurePosixPath(install_dir) / "kvrepro_probe.py"), "sha256": probe_sha256()},
    }
    image_labels = L.image_labels("assembled")
    image_labels.update({
        L.OCI_BASE_NAME: base.ref,
        L.OCI_BASE_DIGEST: base.digest,
        L.LABEL_KEY: key,
        L.LABEL_PATCHES: json.dumps([{"name": p.name, "sha256": p.sha256, **({"reverse": True} if p.reverse else {})}
                                          for p in plan.patches]),
        L.LABEL_PROBE: probe_sha256(),
        L.LABEL_MANIFEST: json.dumps(manifest, sort_keys=True),
    })
    context = _context(base, tree, touched, files, install_dir, image_labels)
    on_line(f"{host.name}: building {tag} FROM {base.ref}")
    image_id = _build(host, context, tag, plan, on_line)
    return Assembly(tag=tag, image_id=image_id, key=key, reused=False, manifest=manifest, labels=image_labels,
                    source_root=tree, seconds=time.monotonic() - started)


def _build(host: DockerHost, context: bytes, tag: str, plan: BuildPlan, on_line: OnLine) -> str:
    step = "docker build"
    image_id = None
    try:
        stream = host.client.api.build(fileobj=io.BytesIO(context), custom_context=True, tag=tag,
                                       rm=True, forcerm=True, decode=True, network_mode="none")
        for chunk in stream:
            if "stream" in chunk:
                text = chunk["stream"].rstrip()
                if text.startswith("Step "):
                    step = text if len(text) < 160 else text[:120] + " ..."
                    text = step
                if text:
                    on_line(f"{host.name}: {text}")
            if "aux" in chunk and "ID" in chunk["aux"]:
                image_id = chunk["aux"]["ID"]
            if "error" in chunk or "errorDetail" in chunk:
                detail = chunk.get("error") or chunk.get("errorDetail", {}).get("message")
                raise ImageBuildError(f"build {plan.name}: image {tag} on host {host.name}: {step}: {detail}")
    except (docker.errors.APIError, docker.errors.BuildError, requests.RequestException) as exc:
        raise ImageBuildError(f"build {plan.name}: image {tag} on host {host.name}: {step}: "
                              f"{getattr(exc, 'explanation', None) or exc}") from None
    if image_id is None:
        image_id = host.client.images.get(tag).id
    return image_id
