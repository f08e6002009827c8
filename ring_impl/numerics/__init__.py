"""Numerics: how partial results combine exactly, whatever the kernel.

- :mod:`.lse`: every kernel's log-sum-exp normalised to one layout.
- :mod:`.merge`: merging partial results through their log-sum-exp.
- :mod:`.nonfinite`: NaN and inf reach exactly the outputs exact arithmetic gives them.
- :mod:`.max_logit`: the per-head maximum attention logit.
"""
