"""Discrete-event simulation of multi-region LLM serving, running the policy layer unchanged."""
