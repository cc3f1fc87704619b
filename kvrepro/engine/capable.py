"""A test-only OffloadingConnector that advertises divergent local hybrid hits (``engine.connector: capable``).

Why: from vLLM 0.28.0 (#50344; on 0.26.0 the backport pr-50344) the scheduler gives a hybrid
model's *divergent* local hit -- full attention's prefix hit deeper than the last saved Mamba
state -- only to a connector whose ``supports_divergent_local_hybrid_hits`` is true
(``Scheduler._get_local_prefix_cache_hit``, 0.28.0 scheduler.py:447, 0.33.0 :668). The connector
is then trusted to restore the lagging recurrent state at the boundary it loads to; if it finds
nothing external the scheduler falls back to the reconciled hit (0.28.0 :865). Upstream, NIXL
declares the capability (nixl/connector.py, 0.28.0 :83) and LMCache's MP connector does not; the
corruption reported behind capable connectors (LMCache #4674, local-inference-lab/vllm #402,
vllm #54302 open) happens on that path. The OffloadingConnector does not declare it, so without
this class kvrepro could never take the path GPU-free.

This class changes nothing but the declaration: the scheduler side, the KV-cache manager and the
offloading scheduler are vLLM's own, and the worker side is the sim's data movement like the
plain connector's. vLLM loads it the way it loads any out-of-tree connector:
``--kv-transfer-config {"kv_connector": "CapableOffloadingConnector", "kv_connector_module_path":
"kvrepro.engine.capable", ...}`` (``KVConnectorFactory.get_connector_class``: a module path
takes priority over the registry, 0.25.1-0.34.0 factory.py:102-120).

What this covers of LMCache and NIXL: the vLLM side of the contract -- which local hit the
scheduler hands a capable connector, the reconcile fallback when nothing external is found, and
whether the KV-cache manager's blocks and the Mamba state that comes back with an external hit
agree at the resume boundary (the shadow KV checks every read). The Mamba state it restores is
the OffloadingConnector's: its lookup requires every group's chunk, Mamba included, up to the hit
it reports, and its load writes the boundary state. What it does not cover: LMCache's own chunk
store and retrieve (its MP server, its layout of recurrent state, what it reports as a hit when it
holds attention KV only), NIXL's prefill-to-decode transfer (``_apply_prefix_caching``, which
sends the prefill's final Mamba state unconditionally), and any GPU kernel. A corruption that only
LMCache's or NIXL's own code makes is therefore not reached here; one that the scheduler's
handling of a divergent hit makes for any capable connector is.

Importable only where vLLM is (the engine process); kvrepro's own stages never import it.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

# what --kv-transfer-config names (kvrepro/versions.py CAPABLE_CONNECTOR)
CONNECTOR_NAME = "CapableOffloadingConnector"


class CapableOffloadingConnector(OffloadingConnector):
    """vLLM's OffloadingConnector, declaring that its external hits restore lagging Mamba state."""

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        # read by the scheduler from 0.28.0 (and on a 0.26.0 stack with pr-50344); releases before
        # that hand every connector the divergent hit, so there the declaration changes nothing
        return True
