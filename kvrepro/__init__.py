"""kvrepro: reproduce vLLM engine crashes and prove, with an A/B build matrix, which fix cures them.

The pipeline, one module per stage: ``spec`` (matrix.yaml) -> ``builds`` -> ``deploy`` (targets)
-> ``loadgen`` -> ``classify`` -> ``results`` -> ``report`` / ``stats``; ``runner`` passes typed
records (``records``) between them and ``cli`` wires commands to them.
"""

__version__ = "0.1.0"


def _is_the_kvrepro_program() -> bool:
    """`kvrepro ...` or `python -m kvrepro.cli ...`, not an import (a test, an engine process)."""
    import os
    import sys

    argv = list(getattr(sys, "orig_argv", None) or [])
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None
    return module == "kvrepro.cli" or os.path.basename(sys.argv[0] if sys.argv else "") == "kvrepro"


if _is_the_kvrepro_program():
    # Ctrl-C, SIGTERM or SIGHUP while typer, rich and kvrepro are imported (a second or two, before
    # `cli.main` installs its handlers): one line, exit 130, no traceback (kvrepro/stopping.py)
    from .stopping import quiet_until_ready

    quiet_until_ready()
