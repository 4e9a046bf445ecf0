"""Attention kernels of our own (C++ sources in csrc/, built at run time) and their routing through transformers'
attention interface."""
