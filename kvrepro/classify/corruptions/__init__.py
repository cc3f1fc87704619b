"""Known corruption defects, one module each (see :mod:`kvrepro.classify.corruption`)."""
