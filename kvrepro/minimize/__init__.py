"""Shrink a failing run's trace to a small reproducer (shrink) and write it as an upstream-style pytest
(pytest_emit).
"""
