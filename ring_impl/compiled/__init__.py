"""``ring_attention`` inside ``torch.compile``.

- :mod:`.checks`: the cross-rank input check of an unmasked call, as a custom op.
- :mod:`.masked_call`: a masked call as a pair of opaque custom ops (forward, backward).
"""
