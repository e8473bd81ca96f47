"""Scheduler planning without a model: budgets, chunking, preemption, prefix hits, forks."""
import pytest

from common.engine.block_manager import BlockManager
from common.config.base import EngineConfig, StepsConfig
from common.protocol.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from common.engine.sequence import FinishReason, Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, **kw):
    cfg = EngineConfig(model="x", block_size=8, max_num_batched_tokens=max(budget, 8), max_num_seqs=max_seqs, **kw)
    object.__setattr__(cfg, "block_size", block_size)
    object.__setattr__(cfg, "max_num_batched_tokens", budget)
    bm = BlockManager(num_blocks, block_size, cfg.enable_prefix_caching)
    return Scheduler(cfg, bm, max_model_len=1024, eos_token_ids=frozenset({0})), bm


def seq(rid, n_prompt, max_tokens=4, n=1, start=1):
    params = SamplingParams(max_tokens=max_tokens, n=n)
    return [Sequence(rid, list(range(start, start + n_prompt)), params, seed=i, index=i) for i in range(n)]


def run_step(s, token=7):
    plan = s.schedule()
    sampled = {q.seq_id: [token] for i, q in enumerate(plan.seqs) if plan.samples(i)}
    s.update(plan, sampled)
    return plan


def test_long_prompt_is_chunked_under_the_budget():
    s, bm = make(budget=16)
    (a,) = seq("a", 40)
    s.add_sequences([a])
    sizes = [run_step(s).num_new_tokens for _ in range(3)]
    assert sizes == [[16], [16], [8]]
    assert a.num_output_tokens == 1  # only the last chunk sampled


def test_the_token_budget_set_at_run_time_chunks_prompts_smaller_and_stays_within_the_configured():
    s, _ = make(budget=16)
    assert s.set_token_budget(8) == 8
    (a,) = seq("a", 20)
    s.add_sequences([a])
    assert [run_step(s).num_new_tokens for _ in range(3)] == [[8], [8], [4]]
    assert s.set_token_budget(1) == 4  # at least a block
    assert s.set_token_budget(1000) == 16  # at most the configured budget
    assert s.set_token_budget(0) == 16  # 0: the configured budget


def test_decodes_go_first_and_share_the_budget_with_a_new_prompt():
    s, bm = make(budget=16)
    (a,) = seq("a", 8)
    s.add_sequences([a])
    run_step(s)
    (b,) = seq("b", 30, start=100)
    s.add_sequences([b])
    plan = run_step(s)
    assert plan.seqs == [a, b] and plan.num_new_tokens == [1, 15]


def test_a_step_with_a_decoding_sequence_takes_at_most_the_decoding_prompt_tokens():
    s, _ = make(budget=64, steps=StepsConfig(decoding_prompt_tokens=8))
    (a,) = seq("a", 8, max_tokens=10)
    s.add_sequences([a])
    assert run_step(s).num_new_tokens == [8]
    (b,) = seq("b", 20, start=100)
    (c,) = seq("c", 4, start=200)
    s.add_sequences([b])
    s.add_sequences([c])
    # a decodes, so b's prompt comes 8 tokens a step and c waits behind it, though the budget holds all of them
    plans = [run_step(s) for _ in range(4)]
    assert [p.seqs for p in plans] == [[a, b], [a, b], [a, b, c], [a, b, c]]
    assert [p.num_new_tokens for p in plans] == [[1, 8], [1, 8], [1, 4, 4], [1, 1, 1]]


def test_a_queue_of_prompts_that_fills_the_budget_by_itself_is_not_capped():
    """Past capacity (a burst, saturation) the decoding streams wait through all the queued prompt work whatever its
    order: full steps then, and the cap again once what is left would not fill one."""
    s, _ = make(budget=32, max_seqs=16, steps=StepsConfig(decoding_prompt_tokens=8))
    (a,) = seq("a", 8, max_tokens=20)
    s.add_sequences([a])
    assert run_step(s).num_new_tokens == [8]
    queued = [seq(name, 12, max_tokens=20, start=100 * (i + 1))[0] for i, name in enumerate("bcd")]
    for q in queued:
        s.add_sequences([q])
    # 36 prompt tokens queued against a budget of 32: a whole step (a's token, then 31 of them)
    plan = run_step(s)
    assert plan.num_new_tokens == [1, 12, 12, 7]
    # 5 left of d's prompt: the cap holds again
    (e,) = seq("e", 12, max_tokens=20, start=900)
    s.add_sequences([e])
    plan = run_step(s)
    assert sum(plan.num_new_tokens[i] for i, q in enumerate(plan.seqs) if q in (queued[2], e)) == 8


def test_without_a_decoding_sequence_a_step_takes_the_whole_budget_for_prompts():
    s, _ = make(budget=64, steps=StepsConfig(decoding_prompt_tokens=8))
    (a,) = seq("a", 20)
    (b,) = seq("b", 12, start=100)
    s.add_sequences([a])
    s.add_sequences([b])
    assert run_step(s).num_new_tokens == [20, 12]


def test_decoding_prompt_tokens_0_leaves_only_the_budget():
    s, _ = make(budget=16, steps=StepsConfig(decoding_prompt_tokens=0))
    (a,) = seq("a", 8)
    s.add_sequences([a])
    run_step(s)
    (b,) = seq("b", 30, start=100)
    s.add_sequences([b])
    assert run_step(s).num_new_tokens == [1, 15]


def test_decoding_prompt_tokens_auto_caps_on_the_cpu_and_not_on_a_gpu():
    assert EngineConfig(model="x").decoding_prompt_tokens == 256
    assert EngineConfig(model="x", device="cuda").decoding_prompt_tokens == 0
    assert EngineConfig(model="x", steps=StepsConfig(decoding_prompt_tokens=64)).decoding_prompt_tokens == 64


def test_preemption_frees_blocks_and_recomputes_later():
    s, bm = make(num_blocks=6, block_size=4, budget=64)
    (a,) = seq("a", 8, max_tokens=12)
    (b,) = seq("b", 8, max_tokens=12, start=50)
    s.add_sequences([a])
    s.add_sequences([b])
    run_step(s)  # both prefilled: 2 + 2 blocks used (+ growth)
    preempted = []
    for _ in range(100):
        if not s.has_work():
            break
        plan = run_step(s)
        preempted += plan.preempted
    assert b in preempted  # the later admission is the victim
    assert a.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.LENGTH
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert bm.num_free_blocks == 6


@pytest.mark.parametrize("lanes, counters, victim", [
    ((0, 0, 0), (0.0, 0.0, 0.0), "c"),  # all equal: the latest admission
    ((0, 2, 1), (0.0, 0.0, 0.0), "b"),  # the lowest lane (p2) first
    ((1, 1, 0), (50.0, 10.0, 99.0), "a"),  # within the lowest lane, the most-served tenant
])
def test_preemption_picks_the_lowest_lane_then_the_highest_counter(lanes, counters, victim):
    s, bm = make(num_blocks=7, block_size=4, budget=64)
    seqs = {}
    for name, lane, counter, start in zip("abc", lanes, counters, (1, 50, 100)):
        (q,) = seq(name, 7, max_tokens=20, start=start)
        q.priority, q.fairness_counter = lane, counter
        s.add_sequences([q])
        seqs[name] = q
    run_step(s)  # 3 x 2 blocks of 7
    preempted = []
    for _ in range(5):
        preempted += run_step(s).preempted
        if preempted:
            break
    assert [q.request_id for q in preempted[:1]] == [victim]
    assert seqs[victim].num_computed_tokens == 0 and not seqs[victim].block_table
    assert all(q not in s.running for q in preempted)


def test_speculative_tokens_are_planned_and_rolled_back():
    s, bm = make(num_blocks=16, block_size=4, budget=64)
    (a,) = seq("a", 6, max_tokens=20)
    s.add_sequences([a])
    run_step(s)  # prefill + first token: 7 tokens, 6 computed
    a.spec_token_ids = [11, 12, 13, 14, 15]
    plan = s.schedule()
    assert plan.num_new_tokens == [6] and plan.spec_token_ids == [[11, 12, 13, 14, 15]]
    assert len(a.block_table) == 3  # positions 6..11 need blocks up to index 2
    s.update(plan, {a.seq_id: [11, 99]})  # one draft accepted, then the target's own token
    assert a.output_token_ids[-3:] == [7, 11, 99] and a.num_computed_tokens == 8
    assert len(a.block_table) == 2 and bm.num_free_blocks == 14  # the block of rejected positions is back
    a.spec_token_ids = [1, 2, 3]
    plan = s.schedule()
    s.update(plan, {a.seq_id: [1, 2, 3, 0]})  # all accepted, then EOS (id 0) as the bonus token
    assert a.finish_reason is FinishReason.STOP and a.output_token_ids[-4:] == [1, 2, 3, 0]
    assert bm.num_free_blocks == 16


def test_drafts_give_way_to_the_budget_and_the_pool():
    s, bm = make(num_blocks=4, block_size=4, budget=3)
    (a,) = seq("a", 3, max_tokens=20)
    s.add_sequences([a])
    run_step(s)
    a.spec_token_ids = [5, 6, 7, 8]
    plan = s.schedule()
    assert plan.spec_token_ids == [[5, 6]]  # budget 3: the last token and two drafts
    s, bm = make(num_blocks=3, block_size=4, budget=64)
    (b,) = seq("b", 6, max_tokens=20)
    s.add_sequences([b])
    run_step(s)
    b.spec_token_ids = list(range(20, 40))
    plan = s.schedule()
    assert plan.spec_token_ids == [[]] and not plan.preempted  # no pool room for the drafts: plain decode
    assert plan.num_new_tokens == [1] and len(b.block_table) == 2


def test_prefix_hit_skips_cached_blocks_but_leaves_one_token():
    s, bm = make(budget=64)
    (a,) = seq("a", 12)
    s.add_sequences([a])
    while s.has_work():
        run_step(s)
    (b,) = seq("b", 12)  # same prompt: 3 full blocks cached, 2 reusable (last token recomputed)
    s.add_sequences([b])
    plan = run_step(s)
    assert b.num_prefix_cached_tokens == 8
    assert plan.num_new_tokens == [4]
    while s.has_work():
        run_step(s)
    assert bm.num_free_blocks == bm.num_blocks


def salted(rid, n_prompt, cache_salt):
    return Sequence(rid, list(range(1, 1 + n_prompt)), SamplingParams(max_tokens=4), seed=0, cache_salt=cache_salt)


def run_all(s):
    while s.has_work():
        run_step(s)


def test_prefix_hits_stay_within_a_cache_salt():
    s, bm = make(budget=64)
    s.add_sequences([salted("a", 12, cache_salt=11)])
    run_all(s)
    others = [salted("b", 12, cache_salt=22), salted("c", 12, cache_salt=0)]
    s.add_sequences(others)
    run_all(s)
    assert [q.num_prefix_cached_tokens for q in others] == [0, 0]  # another tenant's prompt, or an unsalted one
    again = salted("a2", 12, cache_salt=11)
    s.add_sequences([again])
    run_all(s)
    assert again.num_prefix_cached_tokens == 8
    assert bm.num_free_blocks == bm.num_blocks


def test_pulled_pages_are_cached_under_the_sequences_salt():
    s, bm = make(budget=64)
    pulled = salted("d", 12, cache_salt=11)
    pulled.token_ids.append(7)  # the first token, sampled by the prefill worker
    assert s.await_remote_kv(pulled)
    s.remote_kv_arrived(pulled)
    run_all(s)
    same, other = salted("e", 12, cache_salt=11), salted("f", 12, cache_salt=22)
    s.add_sequences([same, other])
    run_all(s)
    assert (same.num_prefix_cached_tokens, other.num_prefix_cached_tokens) == (8, 0)


def test_parallel_samples_share_prompt_blocks():
    s, bm = make(budget=64)
    seqs = seq("a", 10, n=3)
    s.add_sequences(seqs)
    assert seqs[1].status is SequenceStatus.WAITING_FOR_FORK
    run_step(s)
    shared = seqs[0].block_table[:2]
    for sib in seqs[1:]:
        assert sib.block_table == shared and sib.num_computed_tokens == 8
    assert [bm.blocks[b].ref_count for b in shared] == [3, 3]
    plan = run_step(s)
    assert sorted(plan.num_new_tokens) == [1, 2, 2]  # siblings recompute the prompt tail
    while s.has_work():
        run_step(s)
    assert all(q.num_output_tokens == 4 for q in seqs)
    assert bm.num_free_blocks == bm.num_blocks


def test_abort_frees_everything_wherever_the_sequences_are():
    s, bm = make(budget=8)
    seqs = seq("a", 20, n=2)
    s.add_sequences(seqs)
    run_step(s)  # first chunk of the prompt
    aborted = s.abort_request("a")
    assert set(aborted) == set(seqs)
    assert all(q.finish_reason is FinishReason.ABORT for q in seqs)
    assert not s.has_work() and bm.num_free_blocks == bm.num_blocks


def test_eos_and_stop_tokens_finish():
    s, bm = make()
    (a,) = seq("a", 4, max_tokens=10)
    s.add_sequences([a])
    run_step(s, token=0)
    assert a.finish_reason is FinishReason.STOP
    params = SamplingParams(max_tokens=10, stop_token_ids=[7])
    b = Sequence("b", [1, 2], params, seed=0)
    s.add_sequences([b])
    run_step(s, token=7)
    assert b.finish_reason is FinishReason.STOP and b.stop_reason == 7
    assert bm.num_free_blocks == bm.num_blocks


def test_a_plan_run_ahead_preempts_a_sequence_that_its_token_then_ends():
    """Planning ahead of a queued step preempts a sequence whose token is still on the device: it takes its token
    all the same (``settle``), and a stop found then, a stop id or (in its text, later) a stop string, ends it for
    good: out of ``waiting`` as well, never admitted again."""
    for stop_by in ("token", "string"):
        s, bm = make(num_blocks=5, block_size=4, budget=64)
        (a,) = seq("a", 7, max_tokens=10)  # 17 tokens at most: the whole pool's 5 blocks
        (b,) = seq("b", 7, max_tokens=20, start=50)
        s.add_sequences([a])
        s.add_sequences([b])
        run_step(s)  # both prompts in, one token each: 2 blocks each
        queued = s.schedule()  # both decode, each now in its last block's last slot
        ahead, hold = s.run_ahead(queued)
        assert not hold and [q.token_ids[-1] for q in ahead] == [0, 0]  # the placeholders
        plan = s.schedule(hold)  # each next position needs a new block: one left, so b is preempted
        assert plan.preempted == [b] and b in s.waiting and b.num_computed_tokens == 0
        advanced = s.settle(ahead, {a.seq_id: [7], b.seq_id: [0 if stop_by == "token" else 9]})
        assert advanced == [a, b] and b.token_ids[-1] == (0 if stop_by == "token" else 9)
        if stop_by == "string":  # what the output processor does when the token's text completes a stop string
            assert not b.is_finished
            s.finish(b, FinishReason.STOP, "stop")
        assert b.is_finished and b not in s.waiting and b not in s.running and not b.block_table
        assert a in s.running and a.num_computed_tokens == 8 and a.token_ids[-1] == 7
        s.update(plan, {a.seq_id: [7]})
        for _ in range(20):
            if s.has_work():
                run_step(s)
        assert a.finish_reason is FinishReason.LENGTH and b.num_output_tokens == 2 and bm.num_free_blocks == 5
