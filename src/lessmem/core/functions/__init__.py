"""Autograd Functions whose forward is exact but whose saved tensors are compressed, and their math.

Every tensor that backward needs goes through ``ctx.save_for_backward`` so that saved-tensor hooks
(``measure_memory``, checkpointing, offloading) see it; only shapes and scalars live on ``ctx``.
"""
