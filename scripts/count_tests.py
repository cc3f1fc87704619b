#!/usr/bin/env python3
"""Counts what the test suite checks: collected tests (pytest --collect-only) and `assert`
statements in tests/ (parsed, so comments and strings do not count). A change that makes the
suite faster must not lower either number (issue 27). Prints one JSON line.

    .venv/bin/python scripts/count_tests.py
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def collected_tests() -> int:
    # -p no:xdist: count the tests themselves, not how they would be spread over workers
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                          "-p", "no:cacheprovider", "tests"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    found = re.search(r"^(\d+) tests? collected", out, re.M)
    if not found:
        raise SystemExit(f"pytest --collect-only printed no count:\n{out[-2000:]}")
    return int(found.group(1))


def assert_statements() -> int:
    return sum(isinstance(node, ast.Assert)
               for path in sorted((ROOT / "tests").rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text(), str(path))))


if __name__ == "__main__":
    print(json.dumps({"tests": collected_tests(), "asserts": assert_statements()}))
