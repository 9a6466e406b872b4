"""Named presets: each paper's and industry router's policy, registered on import.

Most are compositions of plugins (``register_preset`` on their parameter model); a few are
still written as policy classes and registered as such. The built-in plugins register first,
and the presets in the order ``kvroute policies`` lists them: baselines, industry routers, the
papers.
"""

# ruff: noqa: I001, F401  (registration on import, in listing order)
from kvroute.policy import builtin
from kvroute.policy.base import Policy
from kvroute.policy.catalog import register_policy_class
from kvroute.policy.presets import basic, hashing, sglang, aibrix, vllm, dynamo, llm_d, weighted
from kvroute.policy.presets import skywalker, gorgo, gorgo_tuned, lmetric, cascadeinfer, llumnix

__all__ = ["builtin"]

for _module in (llm_d, gorgo, gorgo_tuned, lmetric, cascadeinfer, llumnix):  # the class-based ones
    for _cls in list(vars(_module).values()):
        if (isinstance(_cls, type) and issubclass(_cls, Policy) and _cls.__module__ == _module.__name__
                and _cls.name):
            register_policy_class(_cls)
