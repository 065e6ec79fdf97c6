"""KV block accounting: which cache blocks are free, and which ids each request holds.

The engine owns the tensors; this pool only lends block ids, so the simulator and the
engine make the same admission and growth decisions. A request's `block_table` lists the
ids it holds, in the order of its tokens: token p lives in block `block_table[p // block_size]`.

Invariants:

- every block id is either free or in exactly one block table, never both;
- so `num_free_blocks` + the blocks every table holds == num_blocks;
- `deallocate` returns every block of a table, so a drained run ends with all free.
"""

from __future__ import annotations

from labkit.checks import whole_number


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """The blocks of `block_size` tokens that `num_tokens` tokens fill: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


class BlockPool:
    """A fixed pool of `num_blocks` KV blocks of `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int):
        whole_number("num_blocks", num_blocks)
        whole_number("block_size", block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_ids = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is lent first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return num_blocks_for(num_tokens, self.block_size)

    def allocate(self, block_table: list[int], num_blocks: int) -> None:
        """Lend `num_blocks` more blocks, appended to `block_table`."""
        assert 0 <= num_blocks <= len(self.free_ids), f"allocate {num_blocks} blocks with {len(self.free_ids)} free"
        if num_blocks:
            block_table.extend(reversed(self.free_ids[-num_blocks:]))
            del self.free_ids[-num_blocks:]

    def deallocate(self, block_table: list[int]) -> None:
        """Take back every block of `block_table`, and empty it."""
        self.free_ids.extend(reversed(block_table))
        block_table.clear()
