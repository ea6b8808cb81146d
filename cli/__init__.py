"""The ``rocketkv-mt`` command: the top layer, above the benchmarks and the server it starts."""
