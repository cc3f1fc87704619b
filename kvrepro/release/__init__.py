"""Release day: a new vLLM release validated in one command, and a later one tried without a code change.

* :mod:`.porting` -- what a release needs that kvrepro/versions.py does not give it, named by the
  porting step (a new worker RPC, a platform check, an executor interface, a renamed identifier in
  a signature) with the vLLM ``file:line``; static (its code) and dynamic (a run's engine log).
* :mod:`.port` -- ``kvrepro release port X``: the porting checklist of versions.py as a command.
* :mod:`.check` -- ``kvrepro release check X``: wheel and sdist, port check, the suite on X with the
  previous release beside it, X's own tests with each entry's upstream tests, an explore campaign,
  and what changed since the previous release (:mod:`.changes`), with bisection of a changed verdict.
"""
