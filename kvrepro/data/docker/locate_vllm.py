"""Run by kvrepro inside a base image (a throwaway container): where is vllm, and its sources.

Prints one JSON line: the folder holding the ``vllm`` package (the site dir the probe's .pth goes
into), whether that folder is a real site dir (one that processes .pth files), Python and vLLM
versions. Writes the package's Python sources (no compiled extensions) to the tar named in
argv[1], so the host can patch and classify against exactly the code this image runs.
Uses only the standard library and does not import vllm (that would need a GPU).
"""

import importlib.util
import json
import os
import site
import sys
import sysconfig
import tarfile

out = sys.argv[1]
spec = importlib.util.find_spec("vllm")
if spec is None or not spec.origin:
    print(json.dumps({"error": "no `vllm` package importable by %s (sys.path: %s)" % (sys.executable, sys.path)}))
    sys.exit(3)
package = os.path.dirname(os.path.realpath(spec.origin))
site_dir = os.path.dirname(package)
site_dirs = [os.path.realpath(p) for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]]]
try:
    from importlib.metadata import version

    vllm_version = version("vllm")
except Exception:  # metadata missing: report what we found rather than fail
    vllm_version = None

count = 0
with tarfile.open(out, "w") as tar:
    for folder, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                tar.add(path, arcname=os.path.relpath(path, site_dir), recursive=False)
                count += 1

print(json.dumps({
    "site_dir": site_dir,
    "site_dir_is_site": os.path.realpath(site_dir) in site_dirs,
    "purelib": sysconfig.get_paths()["purelib"],
    "python": sys.executable,
    "python_version": "%d.%d.%d" % sys.version_info[:3],
    "vllm_version": vllm_version,
    "py_files": count,
}))
