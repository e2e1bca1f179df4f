"""Triton kernels. Importing a module here needs triton; on CPU tensors the kernels run
under ``TRITON_INTERPRET=1`` (set before triton is first imported)."""
