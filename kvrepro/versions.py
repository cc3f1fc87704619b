"""Every piece of knowledge about which vLLM releases exist (minimal stand-in; the lead's module replaces it)."""

from __future__ import annotations

# oldest first: bisection over releases walks this order
SUPPORTED_RELEASES: tuple[str, ...] = (
    "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
)
