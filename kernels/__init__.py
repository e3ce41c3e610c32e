"""Attention and sampling kernels. Each GPU kernel sits beside the PyTorch
reference it is tested against; this package imports nothing from the rest of
specray."""
