"""One module per op: its autograd Function (forward exact, what it saves for backward compressed,
and the math of its backward) and the drop-in layer ``compress`` swaps in for the stock one; the
helpers the ops share (``pooling``, ``dispatch``, ``owned_grad``, ``custom_ops`` for
torch.compile) and the ``registry`` of which stock class becomes which.

Every tensor that backward needs goes through ``ctx.save_for_backward`` so that saved-tensor hooks
(``measure_memory``, checkpointing, offloading) see it; only shapes and scalars live on ``ctx``.

The layers are drop-in subclasses of stock layers. ``compress`` swaps an instance's ``__class__``
to one of these, so parameters, buffers, hooks and ``state_dict`` keys stay exactly those of the
stock layer (an optimizer built before compression keeps working; checkpoints load into either
model).
"""
