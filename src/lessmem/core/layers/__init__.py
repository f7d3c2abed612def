"""Drop-in subclasses of stock layers. ``compress`` swaps an instance's ``__class__`` to one of
these, so parameters, buffers, hooks and ``state_dict`` keys stay exactly those of the stock layer
(an optimizer built before compression keeps working; checkpoints load into either model)."""
