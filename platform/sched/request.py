"""A request as the scheduler sees it: token ids, progress counters, block hashes, status."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from splitserve.platform.hashing import BlockHash, BlockHasher
from splitserve.platform.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"   # blocks allocated; the prompt's KV comes from a prefill worker
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Request:
    """One generation request.

    The scheduler is the only writer of `status`, `num_computed_tokens` and the token lists;
    everyone else reads. `num_computed_tokens` counts tokens whose KV is in the cache;
    `num_cached_tokens` is how many of them came from the prefix cache at first scheduling.
    """

    def __init__(self, req_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                 hasher: BlockHasher, eos_token_ids: frozenset[int] = frozenset(),
                 arrival_time: float | None = None, remote_prefill: bool = False):
        self.req_id = req_id
        self.remote_prefill = remote_prefill  # prompt KV arrives from elsewhere (disaggregated decode)
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self._hasher = hasher
        self.block_hashes: list[BlockHash] = hasher.hash_blocks(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        bs = self._hasher.block_size
        if self.num_tokens % bs == 0:
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.extend(self._hasher.hash_blocks(
                self.all_token_ids, parent=parent, start_block=len(self.block_hashes)))

    def check_stop(self) -> RequestStatus | None:
        """The finish status after the latest token, or None to keep going (stop strings aside)."""
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in self.params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
