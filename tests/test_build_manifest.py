"""The build manifest as a typed record: manifests already on disk (overlays, images, old build.json
files) are read, and written back as they were."""

from __future__ import annotations

import dataclasses

import pytest

from kvrepro.builds.records import BuildManifest, ManifestPatch, ProbeRef
from kvrepro.deploy.records import BuildRecord
from kvrepro.deploy.docker.records import FileChange, HostImage, ImageManifest, ImageRef
from kvrepro.records import RecordError, from_jsonable, to_jsonable

OVERLAY = {"source": "git commit", "repo": "/r", "commit": "a" * 40, "from_wheel": ["vllm/_version.py"],
           "base": "0.26.0", "wheel": "vllm-0.26.0-py3-none-any.whl", "wheel_sha256": "ab" * 32,
           "patches": [{"name": "pr-1", "upstream": "https://x/pull/1", "sha256": "cd" * 32}],
           "probe_sha256": "ef" * 32, "probe_target_sha256": "12" * 32, "overlay_key": "k",
           "overlay_sha256": "34" * 32, "created": "2026-01-01T00:00:00Z"}
IMAGE = {"format": 2, "key": "k", "tag": "kvrepro/vllm:0.26.0-k", "base": "0.26.0", "base_image": "vllm/vllm-openai:v0.26.0",
         "base_image_id": "sha256:1", "base_digest": "sha256:2", "base_digest_source": "repo", "vllm_version_in_base": "0.26.0",
         "python_in_base": "3.12", "site_dir": "/usr/lib/python3/site-packages", "patches": [],
         "files": {"vllm/a.py": {"before": "x", "after": None}},
         "probe": {"path": "/usr/lib/python3/site-packages/kvrepro_probe.py", "sha256": "56" * 32},
         "image": {"tag": "kvrepro/vllm:0.26.0-k", "id": "sha256:3", "labels": {"io.kvrepro": "1"}},
         "hosts": {"local": {"image_id": "sha256:3", "reused": True, "seconds": 0.1}},
         "a_key_from_a_newer_kvrepro": {"kept": True}}


def test_an_overlays_manifest_reads_typed_and_writes_back_the_same():
    m = BuildManifest.from_json(OVERLAY)
    assert m.patches == (ManifestPatch("pr-1", "cd" * 32, "https://x/pull/1"),) and m.from_wheel == ("vllm/_version.py",)
    assert m.probe_hash == "ef" * 32 and m.commit == "a" * 40
    assert to_jsonable(m) == OVERLAY


def test_an_images_manifest_and_unknown_keys():
    m = BuildManifest.from_json(IMAGE)
    assert m.probe == ProbeRef(IMAGE["probe"]["path"], "56" * 32) and m.probe_hash == "56" * 32
    # the docker target's keys are its own record's (the shared manifest keeps them flat, untyped)
    image = ImageManifest.of(m)
    assert image.image == ImageRef("kvrepro/vllm:0.26.0-k", "sha256:3", {"io.kvrepro": "1"})
    assert image.hosts == {"local": HostImage("sha256:3", True, 0.1)} and image.files == {"vllm/a.py": FileChange("x", None)}
    assert image.tag == "kvrepro/vllm:0.26.0-k" and image.format == 2
    assert m.extra["a_key_from_a_newer_kvrepro"] == {"kept": True}
    assert to_jsonable(m) == IMAGE
    # written back through the target's record: the same flat object
    assert to_jsonable(image.onto(BuildManifest.from_json({k: v for k, v in IMAGE.items() if k not in
                                                           {f.name for f in dataclasses.fields(ImageManifest)}}))) == IMAGE
    assert ImageManifest.of(BuildManifest.from_json(OVERLAY)) == ImageManifest()  # an overlay has none
    with pytest.raises(RecordError, match=r"manifest\.hosts"):
        ImageManifest.of(BuildManifest.from_json({**IMAGE, "hosts": {"local": "x"}}))


def test_build_json_as_written_before_reads_with_its_manifest():
    record = from_jsonable(BuildRecord, {"ok": True, "ref": "kvrepro/vllm:0.26.0-k", "reused": True, "manifest": IMAGE})
    assert (ImageManifest.of(record.manifest).image.tag, record.probe_sha256, record.wheel) == ("kvrepro/vllm:0.26.0-k", "56" * 32, None)
    assert from_jsonable(BuildRecord, {"ok": False, "error": "x", "manifest": {}}).manifest == BuildManifest()
    assert from_jsonable(BuildRecord, to_jsonable(record)) == record
    with pytest.raises(RecordError, match=r"manifest\.probe_sha256"):
        from_jsonable(BuildRecord, {"ok": True, "manifest": {"probe_sha256": 7}})
