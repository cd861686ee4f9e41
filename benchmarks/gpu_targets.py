"""benchmarks.gpu's generator targets, kept under this name for the tests; they live in
benchmarks/children/gpt.py."""

from benchmarks.children.gpt import GpuGPT, StaticGpuGPT, cache_bytes, param_bytes

__all__ = ["GpuGPT", "StaticGpuGPT", "cache_bytes", "param_bytes"]
