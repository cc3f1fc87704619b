"""Secrets: a token given to the engine reaches no file and no output, in every spelling of every secret
option of vLLM's real parser; results files are 0644 (issue 8's faults, injected for real:
tests/reliability.py says how).
"""

from __future__ import annotations

import json
import os

import yaml

from conftest import planned_run
from reliability import TOKEN, kvrepro, small_matrix


def test_plan_validate_and_json_never_show_a_token(tmp_path):
    """`matrix plan` (table and --json) and `validate --json` print extra_args with the token masked."""
    matrix = small_matrix(tmp_path)
    for args in (("matrix", "plan", "-m", str(matrix)), ("matrix", "plan", "--json", "-m", str(matrix)),
                 ("matrix", "validate", "--json", "-m", str(matrix))):
        proc = kvrepro(*args)
        assert proc.returncode == 0, proc.stderr
        assert TOKEN not in proc.stdout + proc.stderr
    plan = json.loads(kvrepro("matrix", "plan", "--json", "-m", str(matrix)).stdout)
    assert plan["engine_args"][-2:] == ["--hf-token", "***"]


def test_results_files_are_redacted_and_0644(tmp_path):
    """Every file results.py writes goes through one redaction and gets the usual mode."""
    from kvrepro.results import store as results
    from kvrepro.secrets import remember

    remember([TOKEN])
    folder = results.create_run(tmp_path, f"engine:\n  extra_args: [--hf-token, {TOKEN}]\n", planned_run(build_order=[]))
    results.write_json(folder.rep_dir("A", 0) / "manifest.json", {"engine_args": ["--api-key", "s3cr3t-value"]})
    for path in folder.path.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert TOKEN not in text and "s3cr3t-value" not in text, path
            assert path.stat().st_mode & 0o777 == 0o666 & ~_umask(), (path, oct(path.stat().st_mode))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Every case here is in docs/reliability.md with its line and exit code.
SECRET_WORDS = {"token", "key", "secret", "password", "passwd", "passphrase", "credential", "credentials", "auth"}


# written independently of kvrepro/versions.py: the test must notice if kvrepro's walk misses one
WALK_PARSER = r"""
import json, sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.openai.cli_args import make_arg_parser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
words = set(json.loads(sys.argv[1]))
found = {}
for option, action in parser._option_string_actions.items():
    # the destination names a secret: hf_token, api_key (not long_prefill_token_threshold)
    if option.startswith("--") and action.nargs != 0 and action.dest.lower().split("_")[-1] in words:
        found[option] = [action.dest, action.nargs]
print("WALKED " + json.dumps(found))
print("ALL " + json.dumps(sorted(o for o in parser._option_string_actions if o.startswith("--"))))
print("ABBREV " + json.dumps(parser.allow_abbrev))
"""


def test_every_secret_option_of_the_real_parser_is_masked_in_every_spelling(runtime_python, runtime_scripts):
    """vLLM 0.26.0's own `vllm serve` parser (make_arg_parser, in the runtime env): every option
    whose destination names a secret and takes a value is masked by kvrepro in every spelling the
    parser accepts (-/_, =VALUE or a separate VALUE, every value of a nargs="+" option), so a
    secret option a new release adds is covered by what kvrepro reads from that release's parser."""
    from kvrepro import paths
    from kvrepro.builds import pristine_tree
    from kvrepro.builds import prepare_runtime
    from kvrepro.secrets import redact, redact_args, secret_arg_values
    from kvrepro.matrix.validate import serve_flags

    _, tree, _ = pristine_tree("0.26.0")
    runtime = prepare_runtime("0.26.0")
    env = {**os.environ, "PYTHONPATH": runtime.pythonpath(tree), "VLLM_LOGGING_LEVEL": "ERROR",
           "PYTHONPYCACHEPREFIX": str(paths.home() / "pycache")}
    proc = runtime_scripts.run(runtime_python, ["-c", WALK_PARSER, json.dumps(sorted(SECRET_WORDS))], env=env,
                               timeout=600, cwd=str(tree))
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("WALKED ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    walked = json.loads(line[-1].removeprefix("WALKED "))
    every = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("ALL ")][-1][4:])
    abbrev = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("ABBREV ")][-1][7:])
    assert {"--hf-token", "--api-key"} <= set(walked), walked  # the walk found what we know is there
    assert serve_flags("0.26.0") is not None  # kvrepro reads the same parser (and registers its secrets)
    for option, (dest, nargs) in walked.items():
        spellings = {option, "--" + option[2:].replace("-", "_")}
        if abbrev:  # the shortest prefix the parser takes for this option alone (--hf-tok, --api-k)
            spellings.add(next(option[:n] for n in range(3, len(option) + 1)
                               if [o for o in every if o.startswith(option[:n])] == [option]))
        for spelling in spellings:
            for argv in ([spelling, "v4lue-one"], [f"{spelling}=v4lue-one"],
                         [spelling, "v4lue-one", "v4lue-two", "--max-num-seqs", "4"] if nargs in ("+", "*") else
                         [spelling, "v4lue-one", "--max-num-seqs", "4"]):
                shown = " ".join(redact_args(argv))
                assert "v4lue" not in shown, (option, argv, shown)
                assert "v4lue-one" in secret_arg_values(argv), (option, argv)
                assert "--max-num-seqs 4" in shown or "=" in argv[0] or len(argv) == 2
        underscored = "--" + option[2:].replace("-", "_")
        assert "v4lue" not in redact(f"vllm serve m {underscored} v4lue-one --port 1"), option
        assert "v4lue" not in redact(f"vllm serve m {underscored}=v4lue-one --port 1"), option


def test_secret_in_any_spelling_reaches_no_file_and_no_output(tmp_path, overlays, shared_zygotes_here):
    """`--hf_token VALUE` and `--api_key=VALUE` in extra_args, `HF_TOKEN` and a `*_PASSWORD` in the
    environment: after `matrix run` (table and --json, --junit), `plan`, `validate --json`, `results
    show`, `report`: no file under results/, no JUnit file and no output holds any of them."""
    hf, api = "hf_underscoreSpellingSecret0123456789", "kvrepro-api-key-value-4711"
    env_token, env_password = "hf_environmentSecret9876543210abcd", "envpassword-s3cr3t"
    matrix = small_matrix(tmp_path, builds={"A": []}, expect={"A": "CRASH(target)"})
    data = yaml.safe_load(matrix.read_text())
    data["engine"]["extra_args"] = ["--hf_token", hf, f"--api_key={api}"]
    data["runs"].update(repetitions=1, requests=30)
    matrix.write_text(yaml.safe_dump(data, sort_keys=False))
    env = {**os.environ, "HF_TOKEN": env_token, "KVREPRO_TEST_DB_PASSWORD": env_password}
    results, junit = tmp_path / "results", tmp_path / "out" / "junit.xml"
    outputs = []
    for args in (("matrix", "run", "-m", str(matrix), "--results", str(results), "--junit", str(junit), "--ci"),
                 ("matrix", "run", "-m", str(matrix), "--results", str(results), "--json"),
                 ("matrix", "plan", "-m", str(matrix)), ("matrix", "plan", "--json", "-m", str(matrix)),
                 ("matrix", "validate", "--json", "-m", str(matrix)),
                 ("results", "show", "--json", "--results", str(results)),
                 ("results", "list", "--results", str(results)),
                 ("report", "--results", str(results), "--junit", str(tmp_path / "out" / "again.xml"))):
        proc = kvrepro(*args, env=env)
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.returncode == 0, (args, proc.stderr[-3000:])
        outputs.append(proc.stdout + proc.stderr)
        if args[1] == "run" and "--json" in args:
            run = json.loads(proc.stdout)
    assert run["builds"]["A"]["runs"][0]["label"] == "CRASH(target)"  # the key was sent: the run tested the engine
    files = [p for p in [*results.rglob("*"), *(tmp_path / "out").rglob("*")] if p.is_file()]
    assert any(p.name == "engine.log" for p in files) and any(p.name == "trace.jsonl" for p in files)
    assert junit.is_file() and any(p.name == "report.html" for p in files)
    for secret in (hf, api, env_token, env_password):
        leaked = [str(p) for p in files if secret.encode() in p.read_bytes()]
        assert not leaked, (secret, leaked)
        assert not [i for i, text in enumerate(outputs) if secret in text], secret
