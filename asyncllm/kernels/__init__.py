"""Attention backends (torch reference; Triton kernels for CUDA) and other hot-path ops."""
