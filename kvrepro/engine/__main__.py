"""``python -m kvrepro.engine serve MODEL ARGS``: vLLM's own ``vllm serve MODEL ARGS``, GPU-free.

The arguments after ``kvrepro.engine`` are vLLM's command line, unchanged (``serve`` and what
follows, exactly what a GPU node is given). With ``KVREPRO_SIM=1`` the kvrepro platform plugin
makes it GPU-free (see ``kvrepro.engine.plugin``); the process is otherwise vLLM's CLI.

With ``KVREPRO_ENGINE_ZYGOTE=<socket>`` set, the engine is forked by that zygote, which has the
heavy third-party modules imported already (see ``kvrepro.engine.zygote``); without a zygote
answering it starts here as usual.
"""

import os
import sys


def _run() -> int:
    argv = sys.argv[1:]
    socket_path = os.environ.get("KVREPRO_ENGINE_ZYGOTE")
    if socket_path:
        from kvrepro.engine.zygote import delegate

        code = delegate(socket_path, argv)
        if code is not None:
            return code
        print(f"kvrepro engine: no zygote answers on {socket_path}; starting without it",
              file=sys.stderr, flush=True)
    from kvrepro.engine.vllm_cli import run

    return run(argv)


if __name__ == "__main__":
    sys.exit(_run())
