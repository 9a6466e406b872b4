"""Engine discovery: replicas that come and go at run time, from Kubernetes (EndpointSlices of a
Service), the DNS of a headless Service, or a file re-read on change (a mounted ConfigMap).

Every source yields whole snapshots of the engines it sees; :mod:`kvroute.discovery.reconcile`
turns the differences into the runtime's ``add_replica`` / ``remove_replica`` — the admin API's
path — so discovered engines are probed, ejected, broken and indexed exactly like static ones.
"""
