"""Running deployments for real on one machine: emulated replicas, gateways and a controller on
127.0.0.1 (``kvroute live``, ``kvroute serve`` without a config, the demo's live section), the
TCP delay proxy that stands in for cross-region links, and closed-loop clients over HTTP."""
