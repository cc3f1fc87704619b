"""A planted "next vLLM release" for tests and benchmarks: a real release wheel given a later version
number (and, optionally, a change of vLLM's code such as a renamed worker RPC), served by a real
package index on loopback (PEP 691 JSON, what pip and kvrepro/builds/sdist.py read).

Not a fake of vLLM: every file is the release's own, except the version and the edits asked for.
Compiled extensions are left out (the GPU-free engine never loads them; kvrepro extracts only the
Python sources), so are the native payloads no import reaches (kernel headers, a Rust binary), and
members are stored uncompressed: planting takes seconds, not a minute.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import zipfile
from pathlib import Path

_COMPILED = (".so", ".cubin", ".fatbin", ".pyd")
# native payloads no Python import reaches (their .py files stay): kernel headers for JIT builds, a
# Rust front-end binary
_NATIVE = ("vllm/third_party/", "vllm/vllm-rs")


def plant_wheel(source: Path, version: str, dest: Path, edits: dict[str, tuple[str, str]] | None = None) -> Path:
    """``source`` (a vLLM wheel) as vLLM ``version`` in ``dest``; ``edits``: member path -> (old, new)
    text replaced once (each must be found)."""
    edits = dict(edits or {})
    old_version = re.match(r"vllm-([^-]+)-", source.name)[1]
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / source.name.replace(f"vllm-{old_version}-", f"vllm-{version}-")
    old_info, new_info = f"vllm-{old_version}.dist-info/", f"vllm-{version}.dist-info/"
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            name = info.filename
            if (name.endswith(_COMPILED) or ".so." in name.rsplit("/", 1)[-1] or name.endswith("/RECORD")
                    or (name.startswith(_NATIVE) and not name.endswith(".py"))):
                continue
            data = zin.read(name)
            if name == "vllm/_version.py":
                text = data.decode()
                text = text.replace(repr(old_version), repr(version))
                parts = tuple(int(x) for x in version.split("."))
                text = re.sub(r"version_tuple = \([^)]*\)", f"version_tuple = {parts!r}", text)
                data = text.encode()
            if name.startswith(old_info):
                name = new_info + name[len(old_info):]
                if name.endswith("/METADATA"):
                    data = data.decode().replace(f"\nVersion: {old_version}\n", f"\nVersion: {version}\n", 1).encode()
            if name in edits:
                old, new = edits.pop(name)
                text = data.decode()
                assert old in text, f"{name}: {old!r} not found"
                data = text.replace(old, new, 1).encode()
            zout.writestr(name, data)
        zout.writestr(new_info + "RECORD", "")
    assert not edits, f"not in the wheel: {sorted(edits)}"
    return target


class PlantedIndex:
    """A package index on 127.0.0.1 listing the given vLLM files (PEP 691 JSON for pip and kvrepro,
    a PEP 503 page for other readers) and serving them; counts the requests."""

    def __init__(self, files: list[Path]):
        index = self
        self.requests: list[str] = []
        self.files = {f.name: f for f in files}
        digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                index.requests.append(self.path)
                base = f"http://127.0.0.1:{index.port}"
                if self.path.rstrip("/") == "/simple/vllm":
                    entries = [{"filename": n, "url": f"{base}/files/{n}", "hashes": {"sha256": d}}
                               for n, d in digests.items()]
                    if "json" in (self.headers.get("Accept") or ""):
                        body, kind = json.dumps({"meta": {"api-version": "1.0"}, "name": "vllm", "files": entries}), \
                            "application/vnd.pypi.simple.v1+json"
                    else:
                        links = "".join(f'<a href="{e["url"]}#sha256={e["hashes"]["sha256"]}">{e["filename"]}</a>\n'
                                        for e in entries)
                        body, kind = f"<html><body>\n{links}</body></html>\n", "text/html"
                    self._send(200, body.encode(), kind)
                elif self.path.startswith("/files/") and self.path[7:] in index.files:
                    self._send(200, index.files[self.path[7:]].read_bytes(), "application/octet-stream")
                else:
                    self.send_error(404)

            def _send(self, code, body, kind):
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
