"""``python -m kvrepro.engine <model_dir> <vllm serve args> [--host H] [--port P]``.

With ``KVREPRO_ENGINE_ZYGOTE=<socket>`` set, the engine is forked by that zygote instead of
starting here (see kvrepro.engine.zygote); without a zygote answering it starts here as usual.
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
    from kvrepro.engine.server import main

    return main(argv)


if __name__ == "__main__":
    code = _run()
    # Exit handlers (the probe's last counts line) run, then the process ends without tearing
    # down torch & co. module by module, which adds a second or more to every engine stop.
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
