"""Test tooling shipped with the package: the CPU model of CUDA streams (stream_model.py), used
by the tests and by `fullshard bench` to check stream order and count host syncs."""
