"""Triton kernels (installed as fastopt.kernels)."""
