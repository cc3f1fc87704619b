"""What recorded runs prove, for people and machines: tables and report.md (render), statistics (stats),
plots, the page model (pages), JUnit, and comparisons of two runs (compare).
"""
