"""Fused kernels: C++ for CPU (built on first use), Triton for CUDA."""
