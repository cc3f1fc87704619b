"""``python -m kvrepro.engine <model_dir> <vllm serve args> [--host H] [--port P]``."""

import sys

from kvrepro.engine.server import main

if __name__ == "__main__":
    sys.exit(main())
