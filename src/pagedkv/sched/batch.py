"""What one scheduler step hands to the engine (or to the simulator's cost model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pagedkv.kvcache.hashing import BlockHash
from pagedkv.kvcache.tiers.contract import BlockLoad, PrefixCopy
from pagedkv.sched.sequence import Seq


class ScheduledSeq(NamedTuple):
    """One sequence in a step: compute tokens ``[num_computed_tokens, + num_new_tokens)``.

    Their slots are ``allocator.slot_mapping(seq, num_computed_tokens, num_computed_tokens +
    num_new_tokens)``; attention reads every earlier token of the sequence as context.
    ``num_samples`` is how many tokens the engine samples from the logits of the last new token:
    0 while a prompt chunk does not reach the end of the known tokens (no logits needed), 1
    normally, ``n`` on the last prompt chunk of a request with ``n > 1`` samples (the scheduler
    forks the children from those samples in ``update``).
    """

    seq: Seq
    num_computed_tokens: int  # before this step, prefix-cache hits included
    num_new_tokens: int
    num_samples: int
    prefix_hit_tokens: int  # tokens reused from the prefix cache by an admission in this step

    @property
    def needs_logits(self) -> bool:
        return self.num_samples > 0


@dataclass(frozen=True)
class ScheduledBatch:
    """The plan of one step. The caller may keep it; the sequences inside keep changing.

    Before the forward pass the engine applies, whole blocks and in this order:

    0. ``block_offloads``: ``(device_block, block_hash)`` evicted cached blocks copied into the
       host tier (``kvcache/tiers/contract.py``);
    1. ``swap_out``: ``(device_block, host_block)`` copies of sequences swapped out this step;
    2. ``swap_in``: ``(host_block, device_block)`` copies of sequences swapped back in;
    3. ``block_copies``: ``(src_block, dst_block)`` device copies (copy-on-write of forks),
       and ``prefix_copies``: ``PrefixCopy(src_block, dst_block, num_tokens)``, the first
       ``num_tokens`` slots of a block copied into a fresh one (the matched tokens of a partial
       prefix hit: ``kvcache/partial.py``); empty unless the prefix match unit is below B;
    4. ``block_loads``: ``BlockLoad(tier, block_hash, device_block)`` prefix blocks copied
       from a lower tier into fresh device blocks (counted as computed, like a prefix hit);

    then runs ``seqs``, then applies ``block_saves`` (``(device_block, block_hash)`` full blocks
    the forward pass just computed, written through to a store tier), and calls
    ``Scheduler.update`` with one list of sampled token ids per entry of ``seqs`` (empty where
    ``num_samples == 0``). The order matters: a device block evicted or freed by a swap-out
    may already be reused in the same step (by a new allocation, which a swap-in, a load or
    the forward pass writes), so every offload and swap-out must read its block first. Host
    block ids index a host pool of ``SwapSpace.num_blocks`` blocks in the device pool's block
    layout. The tier orders are empty unless the allocator has lower tiers.

    ``preempted`` lost their device blocks this step: the ``WAITING`` ones will be recomputed,
    the ``SWAPPED`` ones come back through ``swap_in``. ``refused`` are finished with
    ``FinishReason.REFUSED`` and never ran.
    """

    step: int
    seqs: tuple[ScheduledSeq, ...]
    block_copies: tuple[tuple[int, int], ...] = ()
    preempted: tuple[Seq, ...] = ()
    refused: tuple[Seq, ...] = ()
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    block_offloads: tuple[tuple[int, BlockHash], ...] = ()
    block_loads: tuple[BlockLoad, ...] = ()
    block_saves: tuple[tuple[int, BlockHash], ...] = ()
    prefix_copies: tuple[PrefixCopy, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def prefix_hit_tokens(self) -> int:
        return sum(s.prefix_hit_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        """Nothing to run (there may still be refusals or copies to report)."""
        return not self.seqs


class Fork(NamedTuple):
    """A child forked in ``update`` for draw ``sample_offset`` (>= 1) of ``parent``'s first
    token: with the parent's own sample index ``i``, the child is sample ``i + offset``."""

    parent: Seq
    child: Seq
    sample_offset: int


@dataclass(frozen=True)
class StepUpdate:
    """What ``Scheduler.update`` did: the sequences it finished (blocks already freed) and the
    children it forked, in draw order. Lists the caller may keep."""

    finished: list[Seq]
    forked: list[Fork]
