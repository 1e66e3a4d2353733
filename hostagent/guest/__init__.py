"""The in-VM monitor agent: asks the host agent for GPUs, samples them with NVML, heartbeats, gives them back.

Only the standard library and (optionally) pynvml are imported here: this package is installed inside guests, which
have none of the host's dependencies (a guest needs Python 3.11 and, to sample NVIDIA GPUs, pynvml).
"""
