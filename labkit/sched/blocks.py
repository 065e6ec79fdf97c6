"""KV block accounting: which cache blocks are free and which request holds which.

The engine owns the tensors; this pool only hands out block ids, so the simulator and
the engine make the same admission and growth decisions.

Invariants:

- every block id in 0 .. num_blocks-1 is either free or in exactly one request's
  `block_table`, never both: num_free_blocks + sum of table lengths == num_blocks;
- a request's table covers its tokens: len(block_table) == ceil(tokens / block_size)
  for the most tokens it has been grown to;
- `deallocate` returns every block of a request, so a drained run ends with all free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from labkit.sched.state import Request


class BlockPool:
    """A fixed pool of `num_blocks` KV blocks of `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}: must be a whole number >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        """Whether `request` can grow to hold `num_tokens` tokens."""
        return self.num_blocks_for(num_tokens) - len(request.block_table) <= self.num_free_blocks

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Grow `request`'s block table to hold `num_tokens` tokens."""
        num_new_blocks = self.num_blocks_for(num_tokens) - len(request.block_table)
        assert num_new_blocks <= len(self._free), "allocate without can_allocate"
        if num_new_blocks > 0:
            request.block_table.extend(reversed(self._free[-num_new_blocks:]))
            del self._free[-num_new_blocks:]

    def deallocate(self, request: Request) -> None:
        """Return all of `request`'s blocks to the pool."""
        self._free.extend(reversed(request.block_table))
        request.block_table.clear()
