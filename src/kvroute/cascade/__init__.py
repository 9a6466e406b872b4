"""CascadeInfer (004_131677394a4b07f8.txt): length-specialised stages of instances.

One idea per module, all pure (no I/O, no clock): ``qoe`` (§4.1 the QoE model and its
least-squares fit), ``partition`` (§4.2 the stage-partition DP and the two-phase heuristic),
``ranges`` (§4.3 adaptive range refinement and the two naive refinements), ``bidask`` (§4.4 the
decentralised bid-ask protocol).
"""
