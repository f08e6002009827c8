"""What the ranks of a call compare for a MaskMod (ring_impl.masks.probe_text): every entry of a
small call's (batch, head, query, key) grid; beyond 2^20 entries, a grid drawn the same way on
every rank over the whole range, with the power its docstring states. The ranks' refusal itself
is in suites/test_bad_input.py (mask_mod_differs_*), eager, and
tests/ring_impl/test_masks_compile.py compiled."""

from __future__ import annotations

import torch

from ring_impl.masks import PROBE_EDGE, PROBE_ENTRIES, MaskMod, mask_code, probe_grid, probe_text


def causal(b, h, q, kv):
    return kv <= q


def _hiding(where):
    def fn(b, h, q, kv):
        return (kv <= q) & ~where(b, h, q, kv)

    return fn


def test_a_small_call_compares_every_entry() -> None:
    dims = (2, 4, 96, 96)
    assert 2 * 4 * 96 * 96 <= PROBE_ENTRIES
    base = probe_text(causal, *dims)
    gen = torch.Generator().manual_seed(0)
    for _ in range(
        20
    ):  # any single entry (below the diagonal, where causal shows the key) told apart
        b, h = (int(torch.randint(n, (1,), generator=gen)) for n in dims[:2])
        q = int(torch.randint(1, 96, (1,), generator=gen))
        kv = int(torch.randint(0, q, (1,), generator=gen))
        other = probe_text(
            _hiding(
                lambda B, H, Q, K, b=b, h=h, q=q, kv=kv: (B == b) & (H == h) & (Q == q) & (K == kv)
            ),
            *dims,
        )
        assert other != base, (b, h, q, kv)


def test_a_large_call_probes_a_grid_drawn_alike_over_the_whole_range() -> None:
    dims = (16, 32, 8192, 8192)
    bs, hs, qs, ks = probe_grid(*dims)
    again = probe_grid(*dims)  # what another rank draws
    assert all(torch.equal(a, b) for a, b in zip((bs, hs, qs, ks), again))
    assert bs.numel() * hs.numel() * qs.numel() * ks.numel() <= PROBE_ENTRIES
    assert (
        (bs.numel(), hs.numel()) == (8, 16)
        and {0, 15} <= set(bs.tolist())
        and {0, 31} <= set(hs.tolist())
    )
    for positions, n in ((qs, 8192), (ks, 8192)):
        assert positions.tolist()[:PROBE_EDGE] == list(range(PROBE_EDGE))
        assert positions.tolist()[-PROBE_EDGE:] == list(range(n - PROBE_EDGE, n))
        middle = positions[PROBE_EDGE:-PROBE_EDGE]
        assert (
            middle.unique().numel() == middle.numel()
            and float(middle.max() - middle.min()) > 0.8 * n
        )  # spread out


def test_a_difference_on_a_tenth_of_the_rows_is_found_in_a_large_call() -> None:
    """Stated power at m = 90 rows (8 batches x 16 heads): 1 - 0.9^58 > 99.7% for f = 10%; the
    draw is deterministic, so this either always or never holds (it holds)."""
    dims = (8, 16, 65536, 65536)
    base = probe_text(causal, *dims)
    for offset in range(5):  # every 10th row, five different phases
        assert (
            probe_text(
                _hiding(lambda b, h, q, kv, o=offset: (q % 10 == o) & (kv == 0) & (q > 0)), *dims
            )
            != base
        )


def test_the_cross_rank_code_uses_the_probe_and_the_description_alone_without_sizes() -> None:
    late = MaskMod(_hiding(lambda b, h, q, kv: (q == 90) & (kv == 70)))
    early = MaskMod(causal)
    assert (
        late.describe().split(",", 1)[1] == early.describe().split(",", 1)[1]
    )  # the first 64 positions agree
    assert mask_code(late, None, (1, 2, 96, 96)) != mask_code(early, None, (1, 2, 96, 96))
    assert mask_code(early, None, (1, 2, 96, 96)) == mask_code(
        MaskMod(causal), None, (1, 2, 96, 96)
    )
