"""PyTorch's own entry points routed to ring attention.

- :mod:`.context_parallel`: ``context_parallel``: buffers sharded in place, SDPA routed.
- :mod:`.parallel_style`: ``ContextParallel``, a parallel style for a module's attention.
- :mod:`.sdpa_route`: ``scaled_dot_product_attention`` routed while a context is active.
- :mod:`.flex_route`: ``flex_attention(block_mask=...)`` routed while a route is active.
- :mod:`.hybrid_cp`: the hybrid strategy under ``context_parallel``.
"""
