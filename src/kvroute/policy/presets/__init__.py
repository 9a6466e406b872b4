"""Named presets: each paper's and industry router's policy, registered on import.

They are compositions of plugins (``register_preset`` on their parameter model); a policy
written as a class registers with ``register_policy_class`` (CascadeInfer's stage router and its
Llumnix-like baseline were, when they arrived). The built-in plugins register first, and the
presets in the order ``kvroute policies`` lists them: baselines, industry routers, the papers.
"""

# ruff: noqa: I001, F401  (registration on import, in listing order)
from kvroute.policy import builtin
from kvroute.policy.base import Policy
from kvroute.policy.catalog import register_policy_class
from kvroute.policy.presets import basic, hashing, sglang, aibrix, vllm, dynamo, llm_d, weighted
from kvroute.policy.presets import skywalker, gorgo, gorgo_tuned, lmetric, cascadeinfer, llumnix

__all__ = ["builtin"]

for _module in (cascadeinfer, llumnix):  # class-based when they arrived; composed ones register themselves
    for _cls in list(vars(_module).values()):
        if (isinstance(_cls, type) and issubclass(_cls, Policy) and _cls.__module__ == _module.__name__
                and _cls.name):
            register_policy_class(_cls)
