"""Load generation: concurrent /v1/completions traffic against an engine, one JSON line per request.

Public API:

* :func:`run_load` -- run the load of one repetition and return a
  :class:`~kvrepro.records.LoadSummary` saying why it ended (see :mod:`kvrepro.loadgen.runner`).
* :func:`request_id` -- the X-Request-Id each request carries (``kvrepro-<index>``): the engine's
  log names requests by it.
* :class:`Profile` / :class:`Prompt` / :func:`get_profile` / :func:`known_profiles` -- traffic
  shapes, one file each under ``kvrepro/loadgen/profiles/`` (``load.profile`` picks one).

Only the HTTP API is used, so the same load drives the GPU-free engine and a real ``vllm serve``;
:mod:`kvrepro.loadgen.http` is the aiohttp client all requests go through.
"""

from __future__ import annotations

from .profiles import Profile, Prompt, get_profile, known_profiles
from .runner import REQUEST_ID_PREFIX, request_id, run_load

__all__ = ["REQUEST_ID_PREFIX", "Profile", "Prompt", "get_profile", "known_profiles", "request_id", "run_load"]
