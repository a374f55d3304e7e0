"""The engine's host half alone: admission, the prefill budget, preemption and recovery, with no device call."""

from __future__ import annotations

import numpy as np
import pytest

from kvattn.config import AttentionConfig
from kvattn.generation.sampling import Sampling
from kvattn.serving.requests import Request
from kvattn.serving.scheduler import Scheduler


def scheduler(num_pages: int = 7, batch_size: int = 3, prefills_per_step: int = 2, **options) -> Scheduler:
    config = AttentionConfig(num_heads=2, in_features=8, max_len=16, batch_size=batch_size, num_pages=num_pages,
                             page_size=4)
    return Scheduler(config, chunk=8, prefix_caching=True, prefills_per_step=prefills_per_step, **options)


def request(index: int, prompt: list[int], max_new_tokens: int = 4, n: int = 1) -> Request:
    """A leader and its `n - 1` choices, as `Server.submit` makes them."""
    group = [Request(index + i, prompt, max_new_tokens, frozenset({99}), b"", Sampling(), 0, i, 0, None)
             for i in range(n)]
    for sibling in group[1:]:
        sibling.leader = group[0]
    group[0].siblings = group[1:]
    return group[0]


def test_admission_follows_the_page_manager_oldest_first():
    plan = scheduler(num_pages=5)  # 4 usable pages
    assert plan.refusal(17, 1, 1) is not None and "can never fit" in plan.refusal(17, 1, 1)
    assert plan.refusal(4, 2, 4) == "n must be at most the batch size 3, got 4"
    assert plan.refusal(8, 2, 1) is None
    plan.add(request(0, list(range(1, 10))))
    plan.admit()
    counts = np.zeros(3, np.int32)
    counts[0] = 8
    plan.reserve(counts)  # its first chunk: 2 pages of 4 held, 2 left
    for index, length in ((1, 9), (2, 2)):  # 3 pages: later; then one that would fit waits behind it
        plan.add(request(index, list(range(1, length + 1))))
    plan.admit()
    assert [r.index if r else None for r in plan.seqs] == [0, None, None] and len(plan.queue) == 2
    assert plan.prefills() == [0] and plan.next_chunk(0) == (8, 9)
    assert plan.stats().waiting == 2 and plan.stats().running == 1


def test_the_prefill_budget_takes_the_oldest_admitted_first_while_a_request_decodes():
    plan = scheduler(num_pages=13, prefills_per_step=1)
    for index in range(3):
        plan.add(request(index, [1, 2, 3 + index]))
    plan.admit()
    first = plan.prefills()
    assert [plan.seqs[s].index for s in first] == [0, 1, 2]  # nothing decodes: every one, the oldest first
    counts = np.zeros(3, np.int32)
    counts[first[0]] = 3
    plan.reserve(counts)
    assert plan.held(first[0]) == 3 and not plan.prefilling(first[0]) and plan.decoding() == [first[0]]
    assert [plan.seqs[s].index for s in plan.prefills()] == [1]  # one decodes: the budget


def test_running_short_of_pages_preempts_the_youngest_request():
    plan = scheduler(num_pages=5)
    plan.add(request(0, list(range(1, 9))))  # 2 pages
    plan.admit()
    plan.add(request(1, [1, 2, 3]))  # 1 page
    plan.admit()
    assert sum(r is not None for r in plan.seqs) == 2
    counts = np.zeros(3, np.int32)
    for seq, request_ in enumerate(plan.seqs):
        if request_ is not None:
            counts[seq] = len(request_.context) + (8 if request_.index == 0 else 0)  # the elder grows past the pool
    plan.reserve(counts)
    assert [r.index for r in plan.seqs if r is not None] == [0]
    assert [r.index for r in plan.queue] == [1] and plan.queue[0].preemptions == 1
    assert int(np.count_nonzero(counts)) == 1, "the victim's count is zeroed for the caller"
    plan.manager.check()


def test_choices_start_together_and_fork_after_the_prompt():
    plan = scheduler(num_pages=9)
    plan.add(request(0, [1, 2, 3, 4, 5], n=3))
    plan.admit()
    seqs = [s for s, r in enumerate(plan.seqs) if r is not None]
    assert len(seqs) == 3 and plan.prefills() == [seqs[0]]  # only the leader prefills
    counts = np.zeros(3, np.int32)
    counts[seqs[0]] = 5
    plan.reserve(counts)
    plan.prefilled(seqs[0])
    assert [plan.held(s) for s in seqs] == [5, 5, 5] and plan.decoding() == seqs
    assert all(plan.seqs[s].leader is None for s in seqs) and plan.prefills() == []
    plan.manager.check()


def test_abort_retire_and_recover_leave_consistent_books():
    plan = scheduler(num_pages=9)
    for index in range(3):
        plan.add(request(index, [1, 2, 3], max_new_tokens=2))
    plan.admit()
    assert plan.abort(1).finish_reason == "abort" and plan.abort(1) is None
    done_early = next(r for r in plan.seqs if r is not None and r.index == 0)
    done_early.generated += [5, 6]
    stopped = next(r for r in plan.seqs if r is not None and r.index == 2)
    stopped.generated.append(99)
    finished = plan.retire_finished()
    assert sorted((c.request, c.finish_reason) for c in finished) == [(0, "length"), (2, "stop")]
    assert plan.idle
    plan.add(request(3, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    plan.admit()
    plan.recover()  # a failed device call: back to the queue, books afresh
    assert [r.index for r in plan.queue] == [3] and plan.queue[0].preemptions == 1
    assert plan.manager.num_live == 0 and all(s is None for s in plan.seqs)
    plan.manager.check()


@pytest.mark.parametrize("length", [1, 8, 9])
def test_chunks_start_at_multiples_of_the_chunk(length):
    plan = scheduler(num_pages=9)
    plan.add(request(0, list(range(1, length + 1))))
    plan.admit()
    chunks = []
    while plan.prefilling(0):
        start, end = plan.next_chunk(0)
        chunks.append((start, end))
        counts = np.zeros(3, np.int32)
        counts[0] = end - start
        plan.reserve(counts)
    assert chunks == [(0, min(length, 8))] + ([(8, length)] if length > 8 else [])
