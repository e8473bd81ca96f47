"""Scheduler planning without a model: budgets, chunking, preemption, prefix hits, forks."""
from common.block_manager import BlockManager
from common.config import EngineConfig
from common.sampling_params import SamplingParams
from common.scheduler import Scheduler
from common.sequence import FinishReason, Sequence, SequenceStatus


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


def test_decodes_go_first_and_share_the_budget_with_a_new_prompt():
    s, bm = make(budget=16)
    (a,) = seq("a", 8)
    s.add_sequences([a])
    run_step(s)
    (b,) = seq("b", 30, start=100)
    s.add_sequences([b])
    plan = run_step(s)
    assert plan.seqs == [a, b] and plan.num_new_tokens == [1, 15]


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
