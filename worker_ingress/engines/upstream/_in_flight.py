"""What the ``openai`` engine has put on its upstream, as running totals (sans-IO).

The worker cannot see inside the upstream, so between two readings of the upstream's own gauges
(:mod:`worker_ingress.engines.upstream._metrics`) it reports an estimate built from the requests
it forwarded: prompt tokens still prefilling and KV blocks held. See :class:`InFlightLoad`.
"""

from __future__ import annotations

__all__ = ["InFlightLoad"]


class InFlightLoad:
    """The load this engine has put on the upstream, kept as running totals.

    Rules: a request counts its prompt tokens as *prefill* from :meth:`start` until
    :meth:`first_output`; from :meth:`start` until :meth:`finish` it holds
    ceil((prompt + generated) / block_size) blocks. Every method is O(1).

    Args:
        block_size: Tokens per KV block.
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._block_size = block_size
        self._next_key = 0
        # key -> [prompt_tokens, generated_tokens, still_prefilling]
        self._requests: dict[int, list[int]] = {}
        self.prefill_tokens = 0
        self.blocks = 0

    def __len__(self) -> int:
        return len(self._requests)

    def _blocks_of(self, entry: list[int]) -> int:
        return -(-(entry[0] + entry[1]) // self._block_size)

    def start(self, prompt_tokens: int) -> int:
        """A request was sent upstream.

        Args:
            prompt_tokens: Its estimated prompt tokens.

        Returns:
            The key to pass to the other methods.
        """
        key = self._next_key
        self._next_key += 1
        entry = [prompt_tokens, 0, 1]
        self._requests[key] = entry
        self.prefill_tokens += prompt_tokens
        self.blocks += self._blocks_of(entry)
        return key

    def first_output(self, key: int) -> bool:
        """The request's first chunk arrived: its prompt is no longer prefilling.

        Args:
            key: From :meth:`start`.

        Returns:
            Whether anything changed (``False`` after the first call).
        """
        entry = self._requests[key]
        if not entry[2]:
            return False
        entry[2] = 0
        self.prefill_tokens -= entry[0]
        return True

    def generated(self, key: int, tokens: int) -> bool:
        """The request produced ``tokens`` more tokens.

        Args:
            key: From :meth:`start`.
            tokens: How many.

        Returns:
            Whether the block count changed.
        """
        entry = self._requests[key]
        before = self._blocks_of(entry)
        entry[1] += tokens
        after = self._blocks_of(entry)
        self.blocks += after - before
        return after != before

    def finish(self, key: int) -> int:
        """The request ended (completed, failed or cancelled): release everything it held.

        Args:
            key: From :meth:`start`.

        Returns:
            The blocks it held.
        """
        entry = self._requests.pop(key)
        if entry[2]:
            self.prefill_tokens -= entry[0]
        blocks = self._blocks_of(entry)
        self.blocks -= blocks
        return blocks
