"""Commands of the docker target: `kvrepro hosts check`, `kvrepro images ...`, `kvrepro clean`.

Plain functions do the work (hosts.check_host, basecpu.build_base_cpu, clean.clean); these
Typer sub-apps only print their results with rich, or as JSON with --json. kvrepro/cli.py
mounts them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from ... import versions

from ...errors import KvreproError
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pydantic only when a command reads a matrix
    from ...spec.matrix import Matrix

hosts_app = typer.Typer(help="Docker hosts of matrix.yaml.", no_args_is_help=True)
images_app = typer.Typer(help="Images of the docker target.", no_args_is_help=True)

out = Console()
err = Console(stderr=True)

MatrixOpt = typer.Option(Path("matrix.yaml"), "--matrix", "-m", help="the experiment file")
JsonOpt = typer.Option(False, "--json", help="print machine-readable JSON on stdout")


def _emit(value: Any) -> None:
    from ...secrets import redact

    from ...records import to_jsonable

    sys.stdout.write(redact(json.dumps(to_jsonable(value), indent=2, default=str)) + "\n")


def _matrix_or_none(path: Path) -> Matrix | None:
    """The matrix when the file exists; without one the commands act on the local daemon."""
    if not path.exists() and path == Path("matrix.yaml"):
        return None
    from ...spec.matrix import load_matrix
    from .settings import check_settings

    return load_matrix(path, check_target_settings=check_settings).matrix


def _fail(exc: KvreproError) -> None:
    err.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(exc.exit_code)


@hosts_app.command("check")
def hosts_check(matrix: Path = MatrixOpt, as_json: bool = JsonOpt) -> None:
    """For each host: does the daemon answer, GPUs (nvidia runtime), free ports, base image."""
    from .hosts import all_hosts, check_host

    try:
        m = _matrix_or_none(matrix)
    except KvreproError as exc:
        _fail(exc)
    reports = [check_host(spec, m) for spec in all_hosts(m)]
    if as_json:
        _emit(reports)
    else:
        table = Table(title="Docker hosts")
        for col in ("host", "docker", "daemon", "GPUs", "ports", "base image"):
            table.add_column(col)
        notes: list[str] = []
        for r in reports:
            if not r.ok:
                table.add_row(r.name, r.docker, f"[red]{r.error_kind or 'down'}[/]", str(r.gpus_declared), "", "")
                notes.append(f"[red]{r.name}[/]: {r.error or ''}")
                continue
            gpus = str(r.gpus_declared)
            if r.gpus_declared:
                gpus += " ([green]nvidia runtime[/])" if r.nvidia_runtime else " ([red]no nvidia runtime[/])"
            ports = ", ".join(f"{p}: {s}" for p, s in (r.ports or {}).items())
            base = r.base_image
            base_text = (("[green]present[/]" if base.present else "[yellow]absent[/]") if base is not None else "")
            table.add_row(r.name, r.docker, f"[green]up[/] {r.server_version or ''}", gpus, ports, base_text)
            notes += [f"[yellow]{r.name}[/]: {w}" for w in r.warnings or ()]
        out.print(table)
        for note in notes:
            out.print(note, highlight=False)
    if any(not r.ok for r in reports):
        raise typer.Exit(3)


@images_app.command("base-cpu")
def images_base_cpu(
    version: Optional[str] = typer.Option(None, "--version",
                                          help="the vLLM release to install (default: matrix.yaml's base, else 0.26.0)"),
    tag: Optional[str] = typer.Option(None, "--tag", help="default: kvrepro/vllm-openai-cpu:v<version>"),
    rebuild: bool = typer.Option(False, "--rebuild", help="rebuild every layer even if its inputs are unchanged"),
    as_json: bool = JsonOpt,
) -> None:
    """Build (or reuse) the CPU base image on the local daemon: no GPU and no registry needed.

    Debian (debootstrap + docker import) + torch (CPU) + vLLM's dependencies + vLLM itself, as
    vllm/vllm-openai installs them, plus a `vllm` entry that starts kvrepro's GPU-free engine for
    `vllm serve` when the container sees no GPU. Use it with `base_image:` in matrix.yaml.
    """
    from .basecpu import build_base_cpu

    def show(line: str) -> None:
        if line.strip():
            err.out(line, highlight=False)

    try:
        if version is None:
            m = _matrix_or_none(Path("matrix.yaml"))
            version = m.bases[0] if m is not None else versions.DEFAULT_BASE
        result = build_base_cpu(version, tag=tag, rebuild=rebuild, on_line=show)
    except KvreproError as exc:
        _fail(exc)
    if as_json:
        _emit(result)
        return
    table = Table(title=f"{result['tag']} ({'reused' if result['reused'] else 'built'} in {result['seconds']}s)")
    for col in ("layer", "image", "reused", "seconds"):
        table.add_column(col)
    for s in result["steps"]:
        table.add_row(s["step"], s["tag"], "yes" if s["reused"] else "no", str(s["seconds"]))
    out.print(table)
    out.print(f"use it with [bold]base_image: {result['tag']}[/] in matrix.yaml")


@images_app.command("ci")
def images_ci(
    version: str = typer.Option(versions.DEFAULT_BASE, "--version", help="the vLLM release whose dependencies it holds"),
    wheel: Optional[Path] = typer.Option(None, "--wheel", help="the kvrepro wheel to install (default: one built "
                                         "from this checkout)"),
    tag: Optional[str] = typer.Option(None, "--tag", help="default: kvrepro/ci:<version>"),
    as_json: bool = JsonOpt,
) -> None:
    """Build the CI image on the local daemon: kvrepro installed on a CPU-only Debian, GPU-free, from
    local layers only. Run it as `docker run IMAGE suite run --base 0.26.0`."""
    from .ciimage import build_ci_image

    def show(line: str) -> None:
        if line.strip():
            err.out(line, highlight=False)

    try:
        result = build_ci_image(version, kvrepro_wheel=wheel, tag=tag, on_line=show)
    except KvreproError as exc:
        _fail(exc)
    if as_json:
        _emit(result)
        return
    out.print(f"built [bold]{result['tag']}[/] ({result['size_mb']} MB, {result['seconds']} s) on {result['base']}")
    out.print(f"run it: docker run --rm -v $PWD/results:/work/results {result['tag']} suite run --base {version}")


@images_app.command("list")
def images_list(matrix: Path = MatrixOpt, as_json: bool = JsonOpt) -> None:
    """Images kvrepro assembled, with their base digest and ordered patch hashes (from labels)."""
    from . import labels as L
    from .hosts import all_hosts, connect

    try:
        m = _matrix_or_none(matrix)
    except KvreproError as exc:
        _fail(exc)
    rows = []
    for spec in all_hosts(m):
        try:
            host = connect(spec, timeout=30)
        except KvreproError as exc:
            rows.append({"host": spec.name, "error": str(exc)})
            continue
        try:
            for image in host.client.images.list(filters={"label": f"{L.LABEL_IMAGE}=assembled"}):
                labels = image.labels or {}
                rows.append({
                    "host": spec.name, "tags": image.tags, "id": image.id,
                    "base_name": labels.get(L.OCI_BASE_NAME), "base_digest": labels.get(L.OCI_BASE_DIGEST),
                    "patches": json.loads(labels.get(L.LABEL_PATCHES, "[]")),
                    "probe_sha256": labels.get(L.LABEL_PROBE),
                })
        finally:
            host.close()
    if as_json:
        _emit(rows)
        return
    table = Table(title="assembled images")
    for col in ("host", "tag", "base", "base digest", "patches (sha256)"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["host"], "", "", "", f"[red]{r['error']}[/]")
            continue
        patches = ", ".join(f"{p['name']} ({p['sha256'][:12]})" for p in r["patches"]) or "(none)"
        table.add_row(r["host"], ", ".join(r["tags"]), r["base_name"] or "", (r["base_digest"] or "")[:19], patches)
    out.print(table)


def clean(
    matrix: Path = MatrixOpt,
    images: bool = typer.Option(False, "--images", help="also remove the images kvrepro assembled (kvrepro/vllm:*) "
                                                         "and the vLLM cache volumes of their engines"),
    base_images: bool = typer.Option(False, "--base-images", help="also remove the CPU base and its layers"),
    dry_run: bool = typer.Option(False, "--dry-run", help="only list what would be removed"),
    everything: bool = typer.Option(False, "--all", help="also containers of kvrepro runs still in progress"),
    temp_only: bool = typer.Option(False, "--temp-only", help="only the system temp folder; no Docker host is "
                                                               "contacted"),
    as_json: bool = JsonOpt,
) -> None:
    """Remove what kvrepro left: temp folders of kvrepros that are gone (a SIGKILL; never a live
    run's, not even with --all), and leftover containers (and images, if asked) on every host;
    containers of runs still in progress are kept (unless --all)."""
    from ... import scratch

    temp = scratch.clean(dry_run=dry_run)
    temp_report = {"host": "local", "temp": temp.temp, "removed": temp.removed, "kept_temp": temp.kept,
                   "containers": [], "images": [], "kept": [], "errors": list(temp.errors)}
    reports = [temp_report]
    if not temp_only:
        from .clean import clean as do_clean

        try:
            m = _matrix_or_none(matrix)
        except KvreproError as exc:
            _fail(exc)
        reports += do_clean(m, images=images, base_images=base_images, dry_run=dry_run, everything=everything)
    if as_json:
        _emit(reports)
    else:
        verb = "would remove" if dry_run else "removed"
        out.print(f"[bold]temp folder {temp.temp}[/]: {verb} {len(temp.removed)} leftover(s) of kvrepros "
                  f"that are gone", highlight=False)
        for item in temp.removed:
            out.print(f"  {item.kind} {item.path}", highlight=False)
        for item in temp.kept:
            owner = item.owner or {}
            why = item.note or f"its kvrepro (pid {owner.get('pid')}) is still running"
            out.print(f"  kept {item.path}: {why}", highlight=False, markup=False)
        for r in reports[1:]:
            out.print(f"[bold]{r['host']}[/]: {verb} {len(r['containers'])} container(s), {len(r['images'])} image(s)")
            for c in r["containers"]:
                out.print(f"  container {c['name']} ({c['status']}, {c['kind']})")
            for c in r.get("kept", []):
                owner = c.get("owner") or {}
                out.print(f"  kept {c['name']}: its kvrepro (pid {owner.get('pid')} on {owner.get('host')}) "
                          "is still running (--all removes it too)")
            for i in r["images"]:
                out.print(f"  image {', '.join(i['tags']) or i['id'][:19]} ({i['kind']})")
            for name in r.get("volumes", []):
                out.print(f"  volume {name} (vLLM cache)")
            for name in r.get("kept_volumes", []):
                out.print(f"  kept volume {name}: a running engine uses it")
        for r in reports:
            for e in r["errors"]:
                out.print(f"  [red]{e}[/]", highlight=False)
    if any(r["errors"] for r in reports):
        raise typer.Exit(3)


# what kvrepro/cli.py mounts (kvrepro.deploy.target_commands): `kvrepro hosts ...`, `images ...`, `clean`
COMMANDS = {"hosts": hosts_app, "images": images_app, "clean": clean}
