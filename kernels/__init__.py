"""Paged-attention kernels: Triton on CUDA (and under TRITON_INTERPRET=1), plain torch in torch_attention.py."""
