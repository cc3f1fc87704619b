"""What ran: wheels, patches and probe hashes, host, engine arguments (enough to rerun it)."""

from __future__ import annotations


from ... import __version__
from ...results.store import MatrixRun
from ..pages import Block, Bullets, Cell, Code, Heading, Para, Table
from ..render import build_key
from . import SectionContext

ORDER = 80
DETAILS = False


def _short(sha: str | None) -> str:
    return f"`{sha[:12]}`" if sha else "-"


def _what_ran_blocks(run: MatrixRun) -> list[Block]:
    info = run.info
    rows = []
    engine_args: dict[tuple[str, ...], list[str]] = {}
    for b in run.builds:
        record = b.build
        patches = b.manifest.patches if b.manifest else ()
        rows.append((
            build_key(run, b), b.base,
            record.wheel or record.ref or "-" if record else "-",
            _short(record.wheel_sha256) if record else "-",
            ", ".join(f"{p.name}{' (applied in reverse)' if p.reverse else ''} `{p.sha256[:12]}`" for p in patches) or "-",
            _short(record.probe_sha256) if record else "-",
            ", ".join(sorted({_short(r.probe_source_sha256) for r in b.runs if r.probe_source_sha256})) or "-",
            Cell(record.error or ("ok" if record.ok else "failed"), "bad" if record.error else "") if record
            else "-",
        ))
        if b.manifest and b.manifest.engine_args:
            engine_args.setdefault(b.manifest.engine_args, []).append(build_key(run, b))
    host = info.host
    reps = (f"adaptive repetitions (each build until decisive by the stopping rule of docs/statistics.md, at most "
            f"{info.repetitions})" if info.adaptive else f"{info.repetitions} repetition(s) per build")
    facts = [
        f"run `{run.run_id}` ({run.status}), target `{info.target}`, {reps}",
        f"matrix `{info.matrix}` sha256 {_short(info.matrix_sha256)}",
        f"kvrepro {info.kvrepro_version or '?'} (this report: kvrepro {__version__})",
    ]
    if host is not None:
        facts.append(f"host `{host.hostname}`: {host.platform}, Python {host.python}, {host.cpus} CPUs")
    blocks: list[Block] = [
        Heading(2, "What ran"), Bullets(tuple(facts)),
        Table(("build", "vLLM", "wheel / image", "wheel sha256", "patches (sha256)", "probe sha256",
               "wrapped function sha256", "build"), tuple(rows)),
    ]
    for args, names in engine_args.items():
        blocks += [Para(f"engine arguments ({', '.join(names)}):"), Code("vllm serve " + " ".join(args))]
    return blocks


def blocks(run: MatrixRun, context: SectionContext) -> list[Block]:
    return _what_ran_blocks(run)
