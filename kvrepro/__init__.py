"""kvrepro: reproduce vLLM engine crashes and prove, with an A/B build matrix, which fix cures them.

The pipeline, one module per stage: ``spec`` (matrix.yaml) -> ``builds`` -> ``deploy`` (targets)
-> ``loadgen`` -> ``classify`` -> ``results`` -> ``report`` / ``stats``; ``runner`` passes typed
records (``records``) between them and ``cli`` wires commands to them.
"""

__version__ = "0.1.0"
