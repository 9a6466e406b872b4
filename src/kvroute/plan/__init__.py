"""`kvroute plan`: the cheapest deployment that meets an SLO (spec → search → command)."""

MIN_REQUESTS = 50  # requests per simulated run: fewer make every percentile a handful of samples
