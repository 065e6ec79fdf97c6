"""KV block accounting: how many cache blocks are free, and which ids a request holds.

The engine owns the tensors; this pool only lends blocks, so the simulator and the engine
make the same admission and growth decisions. A holder asks for a number of blocks
(`take`); which ids they are is settled when it first needs them (`assign`: the engine,
every step; the simulator, never), so growing many requests costs one subtraction.

Invariants:

- `num_free_blocks` + the blocks every holder holds == num_blocks;
- every block id is either unassigned or in exactly one holder's id list, never both,
  and a holder's list never has more ids than it holds blocks; so at least
  `num_free_blocks` ids are unassigned;
- `give_back` returns every block of a holder, so a drained run ends with all free.
"""

from __future__ import annotations


class BlockPool:
    """A fixed pool of `num_blocks` KV blocks of `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}: must be a whole number >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_free_blocks = num_blocks
        self._unassigned = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is assigned first

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def take(self, num_blocks: int) -> None:
        """Lend `num_blocks` more blocks to a holder."""
        assert 0 <= num_blocks <= self.num_free_blocks, f"take {num_blocks} blocks with {self.num_free_blocks} free"
        self.num_free_blocks -= num_blocks

    def assign(self, block_ids: list[int], num_blocks: int) -> None:
        """Extend a holder's `block_ids` to the `num_blocks` blocks it holds."""
        missing = num_blocks - len(block_ids)
        if missing > 0:
            block_ids.extend(reversed(self._unassigned[-missing:]))
            del self._unassigned[-missing:]

    def give_back(self, block_ids: list[int], num_blocks: int) -> None:
        """Return a holder's `num_blocks` blocks, `block_ids` the ids assigned among them; empties it."""
        self._unassigned.extend(reversed(block_ids))
        block_ids.clear()
        self.num_free_blocks += num_blocks
