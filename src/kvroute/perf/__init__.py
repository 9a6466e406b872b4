"""Step time and hardware, below the policy layer: what an engine's step costs on a profile
(:mod:`.profile`), the round-trip times between regions (:mod:`.network`), and, at the edge, the
YAML loader of the bundled profiles (:mod:`.loader`: reads only when called).

Used by the policy layer (the llm_d predictor), the simulator, the emulator, calibration and the
controller; it imports nothing of theirs.
"""

from kvroute.perf.network import Network, NetworkSpec
from kvroute.perf.profile import HardwareProfile

__all__ = ["HardwareProfile", "Network", "NetworkSpec"]
