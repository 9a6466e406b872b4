"""Named presets: each paper's and industry router's policy, registered on import.

Every preset is a composition of plugins (``register_preset`` on its parameter model). The
built-in plugins register first, then the presets in the order ``kvroute policies`` lists them:
baselines, industry routers, the papers.
"""

# ruff: noqa: I001, F401  (registration on import, in listing order)
from kvroute.policy import builtin
from kvroute.policy.presets import basic, hashing, sglang, aibrix, vllm, dynamo, llm_d, weighted
from kvroute.policy.presets import gke_gateway
from kvroute.policy.presets import skywalker, gorgo, gorgo_tuned, lmetric, cascadeinfer, llumnix, pd
from kvroute.policy.presets import auto
