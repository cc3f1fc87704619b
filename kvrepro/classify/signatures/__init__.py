"""Known crash signatures, one module per crash, each defining ``PATTERN``.

Discovered by :func:`kvrepro.classify.patterns.known_patterns`; see
:class:`kvrepro.classify.patterns.Pattern` for the fields. Each pattern names a test log under
``tests/data/logs/`` that the tests classify and expect this pattern's title from.
"""
