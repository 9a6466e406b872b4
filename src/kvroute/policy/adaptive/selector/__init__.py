"""``auto``'s online selector: the ``ttft_selector`` condition that trials two rules interleaved and
switches to the challenger on evidence of a better mean TTFT, guarded by end-to-end latency
(:mod:`.plugin`), and ``uniform_fleet``, the trust region while the load balancer's fleet is one region
of one hardware kind (:mod:`.uniform`). See README.md."""

from kvroute.policy.adaptive.selector.kv_room import KVRoom
from kvroute.policy.adaptive.selector.plugin import A, B, TTFTSelector
from kvroute.policy.adaptive.selector.uniform import UniformFleet

__all__ = ["A", "B", "KVRoom", "TTFTSelector", "UniformFleet"]
