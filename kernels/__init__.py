"""Triton kernels with plain-torch references. Imports only torch and triton."""
