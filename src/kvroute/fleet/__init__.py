"""Several gateways per region routing as one: the fleet ledger (pure) and its NATS transport.

``ledger.py`` mirrors the other instances' in-flight requests into this instance's Routers;
``sync.py`` carries the messages over NATS; ``services.py`` starts nats-server and HAProxy by
PID for tests and ``kvroute bench fleet`` (``bench.py``).
"""
