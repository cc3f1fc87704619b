"""Requests until the first target crash on build A, over N seeds: our loads vs generic load tools.

Every load runs against the same GPU-free engine: build A of the shipped matrix.yaml (vLLM 0.26.0,
vLLM's own `vllm serve` on the sim target, the matrix's engine section unchanged), one engine per
seed, the engine's seed following the seed as in `kvrepro matrix run` (repetition = seed). A run
that does not crash within the budget counts as the budget (a lower bound) and shows as '-'.

Our loads (kvrepro's profiles) run through `kvrepro matrix run -b A`, the path every run takes;
their count is the load generator's: requests sent when the engine died, the one it died on
included.

The generic loads are `vllm bench serve` (the build's own, run by the runtime env's python with the
build's overlay on PYTHONPATH, as the sim target runs `vllm serve`) and guidellm (installed on
first use into its own venv, ~/.cache/kvrepro/tools/guidellm, never into kvrepro's), each told to
send the budget, one request at a time like our default profile (`--tool-concurrency` changes it),
seeded with the run's seed (`--seed`, guidellm `--seed kind=static,value=N`).

How requests are counted: the tool talks to a counting reverse proxy (counting_proxy.py, beside
this script) in front of the engine. The proxy numbers every generation request
(POST /v1/completions, /v1/chat/completions, /v1/responses) as it passes it on; when one fails
(5xx, a broken connection, an `error` event in its stream or a stream without [DONE]) and the
engine's /health then does not answer 200, the engine is dead and the proxy refuses every later
request itself. The count is the number of generation requests the engine received, the one it
died on included: at concurrency 1 the number of that request, the same measure as our loads'.
Requests the tools send besides (/v1/models, /tokenize, /health) are passed on and not counted;
the engine's access log gives a second count (`engine_log_requests` in --json). A
run counts as a target crash only when kvrepro's classifier finds the target signature in the
engine log (CRASH(target)); a run that died on something else shows as 'x' (CRASH(other)).

Sizes (max_model_len is 1024; the issue names none, so the generic loads take the shape of our
shared_prefix profile: 400-token prefixes = 25 blocks of 16, a short distinct tail, 8 output
tokens with ignore_eos; where a tool has a default prefix count, 10, it is kept):
  vllm bench prefix_repetition: 10 prefixes x 400 tokens, suffix 40, output 8 (prompts shuffled)
  vllm bench random+prefix:     one fixed 400-token prefix + 1-39 random tokens, output 8
  guidellm single-turn:         synthetic_text, 10 prefixes x 400 tokens (system prompt), user
                                prompt 1-39 tokens (uniform), output 8, /v1/chat/completions
  guidellm multi-turn:          the same with turns=5 (history resent each turn; at most
                                ~400 + 5 x 47 tokens + template < 1024)
The tokenizer is the shipped one (kvrepro/data/models/qwen3-next-tiny, byte-level BPE, 1,024
tokens): English words map to ~2.3 tokens, random ids decode to text that re-encodes to about
their number, which vllm bench adjusts for.

    python benchmarks/requests_to_crash.py                      # 10 seeds, budget 2000, every load
    python benchmarks/requests_to_crash.py --seeds 1 --budget 200 --only guidellm
    python benchmarks/requests_to_crash.py --json > out.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # counting_proxy, beside this script

DEFAULT = "partial-prefix (default)"
# name -> the load: section (the shipped matrix's engine, builds and patches are kept)
LOADS: dict[str, dict | None] = {
    DEFAULT: None,  # the shipped matrix's load: as it is
    "shared_prefix (previous default)": {"profile": "shared_prefix", "concurrency": 4, "documents": 6,
                                         "document_tokens": 400, "suffix_tokens": [0, 39], "max_tokens": 8},
    "shared_prefix sequential": {"profile": "shared_prefix", "concurrency": 1, "documents": 6,
                                 "document_tokens": 400, "suffix_tokens": [0, 39], "max_tokens": 8},
    "multi-turn": {"profile": "multi-turn", "concurrency": 1, "max_tokens": 8},
}

TOKENIZER = ROOT / "kvrepro" / "data" / "models" / "qwen3-next-tiny"
GUIDELLM_VENV = Path(os.environ.get("KVREPRO_HOME", Path.home() / ".cache" / "kvrepro")) / "tools" / "guidellm"
GUIDELLM_REQUIREMENTS = ["guidellm==0.8.1"]
PREFIX_TOKENS, PREFIXES, OUTPUT_TOKENS = 400, 10, 8


def _bench(seed: int, budget: int, url: str, model: str, conc: int) -> list[str]:
    return ["--base-url", url, "--model", model, "--tokenizer", str(TOKENIZER), "--endpoint", "/v1/completions",
            "--num-prompts", str(budget), "--max-concurrency", str(conc), "--request-rate", "inf", "--seed", str(seed),
            "--ignore-eos", "--disable-tqdm"]


def _guidellm(seed: int, budget: int, url: str, model: str, conc: int, turns: int) -> list[str]:
    data = (f"kind=synthetic_text,prompt_tokens=20,prompt_tokens_min=1,prompt_tokens_max=39,"
            f"output_tokens={OUTPUT_TOKENS},prefix_tokens={PREFIX_TOKENS},prefix_count={PREFIXES},turns={turns}")
    return ["run", "--backend", f"kind=openai_http,target={url},model={model}",
            "--tokenizer", f"kind=huggingface_auto,model={TOKENIZER}",
            "--profile", "kind=synchronous" if conc == 1 else f"kind=concurrent,streams={conc}", "--data", data,
            "--constraint", f"kind=max_requests,count={budget}",
            "--seed", f"kind=static,value={seed}",
            "--output", "kind=json,path=guidellm.json", "--disable-console-interactive"]


# name -> (tool, its arguments for a seed, a budget, the proxy's URL, the served model name, the concurrency)
GENERIC = {
    "vllm bench prefix_repetition": ("vllm-bench", lambda seed, budget, url, model, conc: [
        *_bench(seed, budget, url, model, conc), "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(PREFIX_TOKENS), "--prefix-repetition-suffix-len", "40",
        "--prefix-repetition-num-prefixes", str(PREFIXES), "--prefix-repetition-output-len", str(OUTPUT_TOKENS)]),
    "vllm bench random+prefix": ("vllm-bench", lambda seed, budget, url, model, conc: [
        *_bench(seed, budget, url, model, conc), "--dataset-name", "random", "--random-prefix-len", str(PREFIX_TOKENS),
        "--random-input-len", "20", "--random-output-len", str(OUTPUT_TOKENS),
        "--random-range-ratio", json.dumps({"input": 0.95, "output": 0.0})]),
    "guidellm single-turn": ("guidellm", lambda seed, budget, url, model, conc:
                             _guidellm(seed, budget, url, model, conc, turns=1)),
    "guidellm multi-turn": ("guidellm", lambda seed, budget, url, model, conc:
                            _guidellm(seed, budget, url, model, conc, turns=5)),
}


@dataclass
class Run:
    seed: int
    requests: int | None  # requests until the target crash; None: none within the budget
    label: str  # CRASH(target), CRASH(other), SURVIVED (no crash), INFRA
    sent: int  # requests the engine received (the budget when it did not crash)
    trigger_count: int = 0  # update_state_after_alloc calls with a local and an offload hit
    state_count: int = 0  # ... in which the bug's state was there
    external_hit_calls: int = 0
    offload_load_jobs: int | None = None
    engine_log_requests: int | None = None  # generic loads: generation requests in the engine's access log
    title: str | None = None
    run_dir: str | None = None
    signature: str | None = None  # the crash signature's name when it died on a known one
    # shadow KV: violation class -> first request (1-based) it was described for; the engine's group kinds
    kv_first_request_by_class: dict | None = None
    kv_groups: list | None = None


# --- our loads: kvrepro matrix run ---------------------------------------------------------------

def _signature_name(signature) -> str | None:
    from kvrepro.classify.patterns import match_pattern

    pattern = match_pattern(signature) if signature is not None else None
    return pattern.name if pattern is not None else None


def run_ours(name: str, load: dict | None, seeds: int, budget: int, workdir: Path,
             matrix: dict | None = None) -> list[Run]:
    """``matrix``: the experiment as YAML data (default: the shipped matrix.yaml); build A runs."""
    matrix = dict(matrix) if matrix is not None else yaml.safe_load((ROOT / "matrix.yaml").read_text())
    if load is not None:
        matrix["load"] = {**load, "seed": 0}
    matrix["runs"] = {**matrix.get("runs", {}), "requests": budget, "duration_s": None, "repetitions": seeds}
    matrix["expect"] = {}
    folder = workdir / "".join(c if c.isalnum() else "-" for c in name)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "builds").symlink_to(ROOT / "builds")
    path = folder / "matrix.yaml"
    path.write_text(yaml.safe_dump(matrix, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "kvrepro.cli", "matrix", "run", "-m", str(path), "-b", "A",
                           "--results", str(folder / "results"), "--json"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        sys.exit(f"{name}: kvrepro matrix run exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    from kvrepro.results import store as results

    recorded = results.load_run(folder / "results", "latest").build("A")
    return [Run(seed=r.rep, requests=r.requests if r.label == "CRASH(target)" else None,
                label=r.label if r.label.startswith(("CRASH", "INFRA")) else "SURVIVED", sent=r.requests,
                trigger_count=r.trigger_count, state_count=r.state_count, external_hit_calls=r.external_hit_calls,
                offload_load_jobs=r.offload_load_jobs, title=r.title, run_dir=r.run_dir,
                signature=_signature_name(r.signature), kv_first_request_by_class=dict(r.kv_first_request_by_class),
                kv_groups=list(r.kv_groups))
            for r in sorted(recorded.runs, key=lambda r: r.rep)]


# --- generic tools: their own client against the engine, through the counting proxy -------------

def ensure_guidellm(log) -> Path:
    """guidellm's CLI in its own venv (made on first use; torch pinned to the CPU build kvrepro uses)."""
    from kvrepro.builds.runtime import TORCH_PIN

    exe = GUIDELLM_VENV / "bin" / "guidellm"
    marker = GUIDELLM_VENV / ".kvrepro-complete"
    wanted = "\n".join([*GUIDELLM_REQUIREMENTS, TORCH_PIN])
    if exe.exists() and marker.exists() and marker.read_text() == wanted:
        return exe
    log(f"installing {' '.join(GUIDELLM_REQUIREMENTS)} into {GUIDELLM_VENV} (once) ...")
    subprocess.run([sys.executable, "-m", "venv", str(GUIDELLM_VENV)], check=True)
    # a plain `torch` requirement would pull a multi-GB CUDA build: pin the CPU one the runtime env uses
    proc = subprocess.run([str(GUIDELLM_VENV / "bin" / "pip"), "install", "-q", *GUIDELLM_REQUIREMENTS, TORCH_PIN],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"installing guidellm failed:\n{proc.stderr[-3000:]}")
    marker.write_text(wanted)
    return exe


class Engine:
    """Build A of the shipped matrix on the sim target, as `kvrepro matrix run` starts it."""

    def __init__(self, matrix_path: Path = ROOT / "matrix.yaml") -> None:
        from kvrepro.deploy.sim import SimTarget
        from kvrepro.matrix import load_matrix

        self.loaded = load_matrix(matrix_path)
        self.target = SimTarget(self.loaded)
        plan = self.loaded.plans(["A"])[0]
        self.artifact = self.target.prepare(plan)
        if not self.artifact.ok:
            sys.exit(f"build A failed: {self.artifact.error}")
        self.runtime = self.target.runtime(plan.base)
        engine = self.loaded.matrix.engine
        self.model = engine.served_model_name or engine.model

    def tool_command(self, tool: str, args: list[str], guidellm: Path | None) -> tuple[list[str], dict[str, str]]:
        from kvrepro import paths
        from kvrepro.secrets import scrubbed_environ

        env = scrubbed_environ()
        env.update(PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        if tool == "vllm-bench":
            env["PYTHONPATH"] = self.runtime.pythonpath(self.artifact.ref or "", paths.SOURCE_ROOT)
            return [str(self.runtime.python), "-m", "vllm.entrypoints.cli.main", "bench", "serve", *args], env
        assert guidellm is not None
        env.pop("PYTHONPATH", None)
        return [str(guidellm), *args], env

    def close(self) -> None:
        self.target.close()


def access_log_requests(log_text: str) -> int:
    """Generation requests in the API server's access log (uvicorn: `"POST /v1/completions HTTP/1.1" 200`):
    a cross-check of the proxy's count (a request the engine never answered leaves no line)."""
    from counting_proxy import GENERATION_PATHS

    return sum(1 for line in log_text.splitlines()
               if any(f'"POST {path} HTTP/' in line for path in GENERATION_PATHS))


def run_generic_one(engine: Engine, name: str, tool: str, make_args, seed: int, budget: int, run_dir: Path,
                    guidellm: Path | None, timeout_s: float, concurrency: int = 1) -> Run:
    from kvrepro import lifetime
    from kvrepro.classify import classify_log, read_engine_counters, read_exposure
    from counting_proxy import CountingProxy
    from kvrepro.records import Outcome

    run_dir.mkdir(parents=True, exist_ok=True)
    runs = engine.loaded.matrix.runs
    handle = engine.target.start(engine.artifact, run_dir, seed)
    proxy = CountingProxy(handle.base_url, trace_path=run_dir / "requests.jsonl").start()
    cmd, env = engine.tool_command(tool, make_args(seed, budget, proxy.url, engine.model, concurrency), guidellm)
    (run_dir / "tool.cmd").write_text(" ".join(cmd) + "\n")
    ended = "tool exited"
    with open(run_dir / "tool.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=lifetime.child_hook())
        started = time.monotonic()
        try:
            while proc.poll() is None:
                if proxy.dead.is_set():
                    ended = "engine died"
                    break
                if not handle.alive():
                    ended = "engine process exited"
                    break
                if proxy.waiting_for() > runs.stall_timeout_s:  # requests in flight, none answered
                    ended = "stall"
                    break
                if time.monotonic() - started > timeout_s:
                    ended = "timeout"
                    break
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            if not proxy.dead.is_set() and handle.alive():
                time.sleep(1.0)  # the engine writes its counters every 0.5 s: let the last ones out
            handle.stop()
            proxy.stop()
    counts = proxy.counts()
    log_text = handle.log_path.read_text(errors="replace") if handle.log_path.exists() else ""
    source_root = Path(engine.artifact.source_root) if engine.artifact.source_root else None
    classification = classify_log(log_text, source_root, engine.loaded.matrix.target_signature)
    exposure = read_exposure(log_text, None)
    counters = read_engine_counters(log_text)
    evidence = dict(trigger_count=exposure.trigger_calls, state_count=exposure.state_calls,
                    external_hit_calls=exposure.external_hit_calls, offload_load_jobs=counters.offload_load_jobs,
                    engine_log_requests=access_log_requests(log_text), run_dir=str(run_dir),
                    signature=_signature_name(classification.signature),
                    kv_first_request_by_class=dict(exposure.kv_first_request_by_class),
                    kv_groups=list(exposure.kv_groups))
    tail = "\n".join((run_dir / "tool.log").read_text(errors="replace").splitlines()[-15:])
    if counts.dead or ended == "engine process exited":
        if classification.outcome is Outcome.TARGET:
            return Run(seed, counts.forwarded, "CRASH(target)", counts.forwarded, title=classification.title,
                       **evidence)
        return Run(seed, None, "CRASH(other)", counts.forwarded,
                   title=classification.title or f"engine died ({counts.failures})", **evidence)
    if ended in ("stall", "timeout"):
        return Run(seed, None, "INFRA", counts.forwarded, title=f"{ended} after {counts.forwarded} requests",
                   **evidence)
    if counts.forwarded < budget or counts.client_errors > 0.05 * max(1, counts.forwarded):
        # the tool stopped short of its budget, or the engine refused its prompts: it did not test the engine
        return Run(seed, None, "INFRA", counts.forwarded,
                   title=f"{name}: tool exit {proc.returncode}, {counts.forwarded} of {budget} requests sent, "
                         f"{counts.client_errors} refused (4xx), failures {counts.failures}; tool log:\n{tail}",
                   **evidence)
    return Run(seed, None, "SURVIVED", counts.forwarded, **evidence)


def run_generic(engine: Engine, name: str, seeds: int, budget: int, workdir: Path, jobs: int, log,
                concurrency: int = 1) -> list[Run]:
    tool, make_args = GENERIC[name]
    guidellm = ensure_guidellm(log) if tool == "guidellm" else None
    folder = workdir / "".join(c if c.isalnum() else "-" for c in name)
    timeout_s = 180.0 + 0.5 * budget  # tool start-up plus a generous per-request allowance

    def one(seed: int) -> Run:
        result = run_generic_one(engine, name, tool, make_args, seed, budget, folder / f"seed-{seed}", guidellm,
                                 timeout_s, concurrency)
        log(f"    seed {seed}: {result.label} after {result.sent} requests "
            f"(trigger {result.trigger_count}, state {result.state_count}, offload loads {result.offload_load_jobs})"
            + (f": {result.title.splitlines()[0]}" if result.label not in ("CRASH(target)", "SURVIVED")
               and result.title else ""))
        return result

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, range(seeds)))


# --- the table -----------------------------------------------------------------------------------

def censored_median(values: list[int | None], budget: int) -> tuple[float, bool]:
    """Median of requests-to-failure with None (nothing within the budget) counted as the budget,
    and whether it rests on such a run (then it is only a lower bound)."""
    ranked = sorted(values, key=lambda v: (v is None, v or 0))
    n = len(ranked)
    censored = any(v is None for v in ranked[(n - 1) // 2: n // 2 + 1])
    return statistics.median([v if v is not None else budget for v in values]), censored


def median_of(runs: list[Run], budget: int) -> float:
    return censored_median([r.requests for r in runs], budget)[0]


def median_censored(runs: list[Run]) -> bool:
    """Does the median rest on a run that did not crash (so it is only a lower bound)?"""
    return censored_median([r.requests for r in runs], 0)[1]


def cell(run: Run) -> str:
    if run.requests is not None:
        return str(run.requests)
    return {"SURVIVED": "-", "CRASH(other)": "x", "INFRA": "!"}.get(run.label, "?")


def summarise(rows: dict[str, list[Run]], budget: int) -> dict:
    medians = {name: median_of(runs, budget) for name, runs in rows.items()}
    base = medians.get(DEFAULT)
    loads = {}
    for name, runs in rows.items():
        loads[name] = {
            "kind": GENERIC[name][0] if name in GENERIC else "kvrepro",
            "per_seed": [r.requests for r in runs],
            "median": medians[name],
            "median_is_lower_bound": median_censored(runs),
            "crashed": sum(r.requests is not None for r in runs),
            "seeds": len(runs),
            "ratio_to_default": round(medians[name] / base, 3) if base else None,
            "runs": [asdict(r) for r in runs],
        }
    generic = {n: m for n, m in medians.items() if n in GENERIC}
    best = min(generic, key=generic.get) if generic else None
    return {"budget": budget, "loads": loads, "default": DEFAULT if base else None,
            "best_generic": best, "best_generic_median": generic.get(best) if best else None,
            "best_generic_over_default": round(generic[best] / base, 3) if best and base else None}


def print_table(summary: dict, seeds: int) -> None:
    budget = summary["budget"]
    print(f"requests until the first target crash on build A ({seeds} seeds, budget {budget}; '-' = no crash "
          f"within the budget, counted as {budget}; 'x' = CRASH(other); '!' = infra)")
    print(f"{'load':34} {'median':>7} {'crashed':>8} {'x default':>9}  per seed")
    for name, load in summary["loads"].items():
        median = f"{'>=' if load['median_is_lower_bound'] else ''}{load['median']:g}"
        ratio = "-" if load["ratio_to_default"] is None else \
            f"{'>=' if load['median_is_lower_bound'] else ''}{load['ratio_to_default']:.2f}"
        cells = " ".join(cell(Run(**r)) for r in load["runs"])
        print(f"{name:34} {median:>7} {load['crashed']:>5}/{load['seeds']:<2} {ratio:>9}  {cells}")
    if summary["best_generic"] and summary["best_generic_over_default"] is not None:
        print(f"best generic load: {summary['best_generic']} (median {summary['best_generic_median']:g}); "
              f"best generic median / our default median = {summary['best_generic_over_default']:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--budget", type=int, default=2000, help="requests per run")
    parser.add_argument("--only", action="append", help="run only loads whose name starts with this (repeatable)")
    parser.add_argument("--jobs", type=int, default=2, help="generic runs at once (one engine each)")
    parser.add_argument("--tool-concurrency", type=int, default=1,
                        help="requests the generic tools keep in flight (1, like our default profile: the count "
                             "is then the number of the request the engine died on; above 1 it also counts the "
                             "requests in flight with it)")
    parser.add_argument("--keep", type=Path, help="keep every run's folder (engine and tool logs) here")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    args = parser.parse_args()
    names = [n for n in [*LOADS, *GENERIC] if not args.only or any(n.startswith(o) for o in args.only)]
    if not names:
        sys.exit(f"--only matches no load; loads: {', '.join([*LOADS, *GENERIC])}")

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    rows: dict[str, list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="kvrepro-bench-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        engine = Engine() if any(n in GENERIC for n in names) else None
        try:
            for name in names:
                log(f"running {name} ...")
                if name in LOADS:
                    rows[name] = run_ours(name, LOADS[name], args.seeds, args.budget, workdir)
                else:
                    assert engine is not None
                    rows[name] = run_generic(engine, name, args.seeds, args.budget, workdir, args.jobs, log,
                                             args.tool_concurrency)
                log(f"  {name}: {[cell(r) for r in rows[name]]}")
        finally:
            if engine is not None:
                engine.close()
    summary = summarise(rows, args.budget)
    summary["seeds"] = args.seeds
    summary["tool_concurrency"] = args.tool_concurrency
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_table(summary, args.seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
