"""The known-defect suite: defects/ (one file per known defect) run against releases and patch stacks.

* ``catalogue``: the files, validated (file:line errors), and what each expects of a build;
* ``run``: each entry as a matrix through the matrix runner, recorded under results/suite-<id>/;
* ``judge``: one row per entry and build (PRESENT, ABSENT, UNREACHED, OTHER, NOT TESTABLE, INFRA);
* ``report``: the table, JSON, JUnit and the exit code.

docs/suite.md describes the catalogue format and how to add an entry.
"""
