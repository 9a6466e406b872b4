"""``kvroute epp``: kvroute as the Gateway API inference extension's endpoint picker — Envoy's
ext_proc gRPC service that tells the gateway which engine (and which fallbacks) to send each
request to, using the same Router, probes, breakers and discovery as ``kvroute serve``."""
