"""`kvrepro explore`: a seeded campaign over the vocabulary kvrepro has, judged by every oracle.

vocabulary (knobs) -> generator (seeded run specs, weighted by coverage) -> matrix runner (sim; ray) ->
judge (crash classifier, shadow KV, stall detector, request invariant; titles; the catalogue) ->
coverage (what was reached; the weights) -> state (explore.json after every run; ``--resume``).
docs/explore.md says what exists and what is next.
"""

from .campaign import load_campaign, new_campaign, parse_budget, rerun_spec, run_campaign, summary
from .state import CampaignRequest, CampaignState

__all__ = ["CampaignRequest", "CampaignState", "load_campaign", "new_campaign", "parse_budget", "rerun_spec", "run_campaign",
           "summary"]
