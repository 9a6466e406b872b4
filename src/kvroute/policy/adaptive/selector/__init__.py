"""``auto``'s online selector: the ``ttft_selector`` condition that trials two rules interleaved and
switches to the challenger on evidence of a better mean TTFT, guarded by end-to-end latency
(:mod:`.plugin`). See README.md."""

from kvroute.policy.adaptive.selector.plugin import A, B, TTFTSelector

__all__ = ["A", "B", "TTFTSelector"]
