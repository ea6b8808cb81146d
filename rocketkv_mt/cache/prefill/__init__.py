"""Prefill policies: what a turn's prefill keeps on the device and which set decode reads."""
