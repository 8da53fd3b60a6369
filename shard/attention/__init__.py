"""Attention behind one interface: a portable torch backend (CPU and CUDA) and GPU kernels."""
