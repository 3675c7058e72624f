"""A policy written outside the package, as a user would: paged with 64-token blocks whatever
block size the caller asks for. Loaded by tests as ``path/custom_policy.py:CoarseBlocks``."""
from vmemkv.scheduler.managers import PagedManager
from vmemkv.scheduler.managers.base import MemoryManager


class CoarseBlocks(PagedManager):
    """Paged allocation in 64-token blocks (ignores ``block_size_tokens``)."""

    def __init__(self, model, cache_bytes, max_seq_len_tokens, **options):
        super().__init__(model, cache_bytes, max_seq_len_tokens, block_size_tokens=64,
                         swap_bytes=options.get("swap_bytes", 0))
        self.name = "coarse-blocks"


class NotAManager:
    """Refused: not a MemoryManager subclass."""


class BrokenAboveOneGB(PagedManager):
    """Paged, but fails to build above 1 GB of cache: one failing point of a sweep."""

    def __init__(self, model, cache_bytes, max_seq_len_tokens, **options):
        if cache_bytes > 10**9:
            raise RuntimeError(f"no support for {cache_bytes} bytes (test policy)")
        super().__init__(model, cache_bytes, max_seq_len_tokens, block_size_tokens=16)


class TakesNothing(PagedManager):
    """Refused when the config is made: its constructor takes no sizes or options."""

    def __init__(self, model, cache_bytes):
        super().__init__(model, cache_bytes, 4096)


class Abstract(MemoryManager):
    """Refused when the config is made: it implements nothing."""
