"""``ring_impl.planning.mask_table``: a mask packed into bits on the global grid (how a MaskMod
enters a compiled graph) reads back exactly as the float64 oracle's visibility (``reference.masks``,
written independently), for key lengths that are and are not multiples of 8, masks that depend
on the batch or the head, any row chunking; its description changes with any single bit, it
refuses a grid it was not built for, and a table over the limit is not built."""

from __future__ import annotations

import pytest
import torch

from reference.masks import visibility as oracle_visibility


def _per_batch_head(b, h, q_idx, kv_idx):
    """Batch 1 sees nothing past position 5; head h sees h + 1 keys back, causally."""
    return (kv_idx <= q_idx) & (kv_idx >= q_idx - h - 1) & ((b == 0) | (kv_idx <= 5))


def _spec(name: str) -> dict:
    return {
        "causal": {"kind": "causal"},
        "documents": {
            "kind": "document",
            "doc_ids": [0] * 5 + [1] + [2] * 9 + [-1] * 6,
            "causal": True,
        },
        "window": {"kind": "sliding_window", "left": 3, "right": 2},
        "per_batch_head": {"kind": "mask_mod", "fn": _per_batch_head},
    }[name]


def _read_back(table, batch: int, heads: int, seq_q: int, seq_kv: int) -> torch.Tensor:
    from ring_impl.masks import visibility

    return visibility(
        table, torch.arange(seq_q), torch.arange(seq_kv), batch=batch, heads=heads
    ).expand(batch, heads, seq_q, seq_kv)


# Key lengths that are not and are a multiple of 8 (the last byte padded); documents share one
# sequence of 21 tokens.
@pytest.mark.parametrize(
    "name,seq_kv",
    [
        ("causal", 21),
        ("causal", 24),
        ("documents", 21),
        ("window", 21),
        ("window", 24),
        ("per_batch_head", 21),
        ("per_batch_head", 24),
    ],
)
@pytest.mark.parametrize("chunk_entries", [None, 8])  # one chunk; a row or less per chunk
def test_table_reads_back_as_the_oracle(monkeypatch, name, seq_kv, chunk_entries) -> None:
    import ring_impl.planning.mask_table as mask_table
    from ring_impl.masks import from_spec
    from ring_impl.planning.mask_table import VisibilityTable, pack_visibility

    spec = _spec(name)
    seq_q, batch, heads = 21, 2, 3
    if chunk_entries is not None:
        monkeypatch.setattr(mask_table, "CHUNK_ENTRIES", chunk_entries)
    bits = pack_visibility(from_spec(spec), seq_q=seq_q, seq_kv=seq_kv, batch=batch, heads=heads)
    assert bits.dtype == torch.uint8 and bits.shape[2:] == (seq_q, -(-seq_kv // 8)), bits.shape
    # Only a mask that depends on the batch and head has those dims.
    assert bits.shape[:2] == ((batch, heads) if name == "per_batch_head" else (1, 1)), bits.shape
    table = VisibilityTable(bits, seq_kv)
    assert table.check(seq_q, seq_kv) is None
    got = _read_back(table, batch, heads, seq_q, seq_kv)
    want = oracle_visibility(spec, seq_q, seq_kv, batch=batch, heads=heads)
    assert torch.equal(got, want.expand_as(got)), (
        f"{name}: {int((got != want).sum())} position pairs read back wrong, first at "
        f"{(got != want).nonzero()[:1].tolist()}"
    )
    # Padding bits of the last byte are not seen.
    if seq_kv % 8:
        assert int(bits[..., -1].max()) < (1 << (seq_kv % 8)), "padding keys marked as seen"


def test_description_follows_every_bit() -> None:
    from ring_impl.masks import Causal
    from ring_impl.planning.mask_table import VisibilityTable, pack_visibility

    bits = pack_visibility(Causal(), seq_q=16, seq_kv=16, batch=1, heads=1)
    same = VisibilityTable(bits.clone(), 16)
    assert VisibilityTable(bits, 16).describe() == same.describe()
    assert same.exact_digest, "a table's description covers all its data: plans may be cached by it"
    for row, byte, bit in ((0, 0, 1), (15, 1, 7), (7, 0, 0)):
        flipped = bits.clone()
        flipped[0, 0, row, byte] ^= 1 << bit
        assert VisibilityTable(flipped, 16).describe() != same.describe(), (row, byte, bit)


def test_table_refuses_another_grid_and_the_limit_is_kept() -> None:
    from ring_impl.masks import Causal, mask_problem
    from ring_impl.planning.mask_table import VisibilityTable, pack_visibility

    bits = pack_visibility(Causal(), seq_q=16, seq_kv=16, batch=1, heads=1)
    problem = mask_problem(VisibilityTable(bits, 16), seq_q=32, seq_kv=32, batch=1, heads=1)
    assert problem is not None and "global sequence" in problem, problem
    assert "uint8" in VisibilityTable(bits.to(torch.int32), 16).check(16, 16)
    assert (
        pack_visibility(Causal(), seq_q=16, seq_kv=16, batch=1, heads=1, max_bits=16 * 16 - 1)
        is None
    )
    assert (
        pack_visibility(Causal(), seq_q=16, seq_kv=16, batch=1, heads=1, max_bits=16 * 16)
        is not None
    )


# --- EvaluationGuard: failures on data recorded, not raised ---------------------------------------

_T = torch.arange(10) * 3
_M = torch.arange(24).view(2, 3, 4)

#: name -> a function of integer tensors (i, d) that fails on data: an index ``i`` outside its dim,
#: or a zero divisor ``d``
_FORMS = {
    "getitem": lambda i, d: _T[i],
    "getitem_tuple": lambda i, d: _M[
        :, i % 3, i % 4 + (i >= 100).long() * 100
    ],  # the last dim fails
    "getitem_ellipsis": lambda i, d: _M[..., i],
    "getitem_none": lambda i, d: _M[None, i % 2 + (i >= 100).long() * 100, :, 0],
    "index_select": lambda i, d: torch.index_select(_T, 0, i),
    "method_index_select": lambda i, d: _T.index_select(0, i),
    "gather": lambda i, d: torch.gather(
        _M[0], 1, i.view(1, -1).expand(3, -1) % 4 + (i >= 100).long() * 100
    ),
    "take": lambda i, d: torch.take(_M, i),
    "floordiv": lambda i, d: i // d,
    "rfloordiv": lambda i, d: 7 // d,
    "mod": lambda i, d: i % d,
    "remainder": lambda i, d: torch.remainder(i, d),
    "fmod": lambda i, d: torch.fmod(i, d),
    "div_floor": lambda i, d: torch.div(i, d, rounding_mode="floor"),
}
_FAILS_ON = {
    "getitem": "index",
    "getitem_tuple": "index",
    "getitem_ellipsis": "index",
    "getitem_none": "index",
    "index_select": "index",
    "method_index_select": "index",
    "gather": "index",
    "take": "index",
}


def _guarded(form: str, i: torch.Tensor, d: torch.Tensor):
    from ring_impl.planning.mask_table import EvaluationGuard

    guard = EvaluationGuard()
    with guard:
        out = _FORMS[form](i, d)
    return out, guard.failed


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("form", sorted(_FORMS))
def test_the_guard_records_a_failure_on_data_instead_of_raising(form, compiled) -> None:
    """In range, the guarded result is the plain one and the flag stays clear; out of range (an
    index 100, a divisor 0) the plain call raises, the guarded one does not and sets the flag,
    also traced by dynamo with fullgraph=True (as the compiled masked call traces a MaskMod)."""
    if compiled:
        torch._dynamo.reset()  # a graph per form: not the recompile limit of one function
    fn = torch.compile(_guarded, backend="eager", fullgraph=True) if compiled else _guarded
    good_i, good_d = torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3])
    out, failed = fn(form, good_i, good_d)
    assert torch.equal(out, _FORMS[form](good_i, good_d)) and not bool(failed), (out, failed)
    bad_i, bad_d = (
        (torch.tensor([0, 100, 2]), good_d)
        if _FAILS_ON.get(form) == "index"
        else (good_i, torch.tensor([1, 0, 3]))
    )
    with pytest.raises((IndexError, RuntimeError)):
        _FORMS[form](bad_i, bad_d)
    _, failed = fn(form, bad_i, bad_d)
    assert bool(failed), f"{form}: the failure was not recorded"
