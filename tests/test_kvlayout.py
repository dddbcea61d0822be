"""``integrations.agent.kvtypes.KVLayout``: what two sides must agree on (its
digest), and the units the engine registers (one KV head of one block), which
let instances of different tensor-parallel sizes move head ranges."""

from __future__ import annotations

import pytest

from aiokvcache.integrations.agent.kvtypes import KVLayout, head_units


def layout(heads: int = 1, total: int = 0, block_bytes: int = 4096, **kw: object) -> KVLayout:
    return KVLayout(2, 1, 8, block_bytes, 32, (1, 2), "bf16", heads=heads, total_heads=total, **kw)  # type: ignore[arg-type]


def test_units_are_each_blocks_heads_in_order() -> None:
    two = layout(heads=2, total=2)
    assert two.unit_bytes == 2048
    assert two.units([3, 5]) == [6, 7, 10, 11]
    assert two.units([3, 5], head=1, count=1) == [7, 11]
    assert layout().units([3, 5]) == [3, 5]
    assert head_units([0, 4], 4, 1, 2) == [1, 2, 17, 18]
    with pytest.raises(ValueError, match=r"heads \[1, 3\) of a block of 2"):
        two.units([1], head=1, count=2)


def test_the_digest_agrees_across_tensor_parallel_sizes_of_one_model() -> None:
    """Rank of TP 1 (two heads a block) and of TP 2 (one): the same model,
    the same digest; per rank (what a push, which writes whole blocks,
    checks) they differ. A model of another head count differs."""
    tp1 = layout(heads=2, total=2, block_bytes=4096)
    tp2 = layout(heads=1, total=2, block_bytes=2048)
    assert tp1.digest() == tp2.digest()
    assert tp1.digest(per_rank=True) != tp2.digest(per_rank=True)
    assert layout(heads=1, total=1, block_bytes=2048).digest() != tp2.digest()
    # Not head-major (total unknown): the whole block counts, as before.
    assert layout(block_bytes=4096).digest() != layout(block_bytes=2048).digest()
    assert layout().digest() != layout(groups="sw64,full").digest()


@pytest.mark.parametrize(("heads", "total", "bb"), [(0, 0, 4096), (3, 3, 4096), (2, 3, 4096)])
def test_heads_that_do_not_divide_are_refused(heads: int, total: int, bb: int) -> None:
    with pytest.raises(ValueError):
        layout(heads=heads, total=total, block_bytes=bb)
