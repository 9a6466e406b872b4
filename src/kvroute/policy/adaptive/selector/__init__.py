"""``auto``'s online selector: the ``ttft_selector`` condition that explores two rules and keeps
the one with the better p90 TTFT, guarded by end-to-end latency (:mod:`.plugin`). See README.md."""

from kvroute.policy.adaptive.selector.plugin import A, B, TTFTSelector

__all__ = ["A", "B", "TTFTSelector"]
