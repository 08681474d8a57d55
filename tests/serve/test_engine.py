"""The scheduler in-process: continuous batching with chunked prefill equals `generate` alone,
the prefix cache changes no token, cancelled and finished requests free their slots, end tokens
and stop strings, a failing step, the queue bound and shutdown."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.io.tokenizers import ByteTokenizer
from xlstm_kit.serve.engine import Engine, EngineBusy, EngineClosed
from xlstm_kit.serve.request import Request, SamplingParams
from xlstm_kit.serve.slots import _buckets
from xlstm_kit.serve.prefix_cache import PrefixCache

from .conftest import tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompts(lengths, seed=1, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def alone(model, p, n=12):
    return model.generate(torch.tensor(p), max_new_tokens=n, temperature=0)[len(p):].tolist()


def run(engine, ps, params=GREEDY):
    try:
        return engine.start().generate(ps, params)
    finally:
        engine.close()
        engine.join(30)


def test_batched_chunked_prefill_equals_generate_alone(model):
    # 4 slots for 12 requests of different lengths and budgets: requests join as others end
    # (rows move), prompts longer than the 16-token chunk are read over several passes
    ps = prompts([1, 40, 7, 23, 16, 60, 3, 17, 33, 2, 48, 9])
    budgets = [5, 12, 1, 9, 12, 3, 7, 12, 2, 11, 6, 8]
    reqs = [Request(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(ps, budgets)]
    engine = Engine(model, ByteTokenizer(), max_batch=4, prefill_chunk=16, prefix_cache_bytes=0).start()
    try:
        engine.submit(reqs)
        for r in reqs:
            assert r.done.wait(60)
    finally:
        engine.close()
        engine.join(30)
    for p, n, r in zip(ps, budgets, reqs):
        assert r.finish_reason == "length" and r.output == alone(model, p, n)
    assert engine.stats.decode_steps < sum(budgets) - len(budgets)  # steps were shared
    assert engine.stats.prefill_tokens == sum(map(len, ps))


class FirstTokenSteps:
    """An engine's deliver= callback: per request, the decode steps taken when its first token
    went out (set .engine before the first update)."""

    def __init__(self):
        self.engine, self.at = None, {}

    def __call__(self, updates):
        for u in updates:
            if u.token_ids:
                self.at.setdefault(u.request.id, self.engine.stats.decode_steps)


def test_the_first_token_goes_out_before_the_decode_step(model):
    # a request's first token comes from its prompt's logits: its update is sent in the pass
    # that read the prompt, before that pass's step (which on the CPU computes before it returns)
    deliver = FirstTokenSteps()

    engine = deliver.engine = Engine(model, ByteTokenizer(), prefix_cache_bytes=0, deliver=deliver).start()
    lone = Request(prompts([5])[0], SamplingParams(max_tokens=4, temperature=0), stream=True)
    try:
        engine.submit([lone])
        assert lone.done.wait(60)
    finally:
        engine.close()
        engine.join(30)
    assert lone.output == alone(model, prompts([5])[0], 4)
    assert deliver.at == {lone.id: 0}


def test_requests_that_arrive_together_get_their_first_tokens_in_the_same_pass(model):
    # each prompt gets its own chunk per pass and they are read together: with one chunk for
    # the whole pass the fourth request's first token would wait three passes (three steps)
    deliver = FirstTokenSteps()

    ps = prompts([16, 11, 16, 5], seed=3)
    reqs = [Request(p, SamplingParams(max_tokens=3, temperature=0), stream=True) for p in ps]
    engine = deliver.engine = Engine(model, ByteTokenizer(), max_batch=4, prefill_chunk=16, prefix_cache_bytes=0,
                                     deliver=deliver)
    engine.start()
    reads = []
    real_read = engine.reader.read
    engine.reader.read = lambda rows, tokens: reads.append(len(rows)) or real_read(rows, tokens)
    try:
        engine.submit(reqs)
        for r in reqs:
            assert r.done.wait(60)
    finally:
        engine.close()
        engine.join(30)
    assert [r.output for r in reqs] == [alone(model, p, 3) for p in ps]
    assert deliver.at == {r.id: 0 for r in reqs}
    assert reads == [4]


def test_a_steps_tokens_are_taken_after_their_copy_to_the_host(model, monkeypatch):
    # on CUDA each step's tokens are copied to the host behind the step and taken once that
    # copy (not the next step) is done; here the copy and its event are stand-ins
    from xlstm_kit.serve import engine as engine_module

    events = []

    class Copied:
        def __init__(self):
            self.waited = False
            events.append(self)

        def synchronize(self):
            self.waited = True

    monkeypatch.setattr(engine_module, "_to_host", lambda ids: (ids.clone(), Copied()))
    ps = prompts([3, 9, 4])
    reqs = run(Engine(model, ByteTokenizer(), max_batch=2, prefix_cache_bytes=0), ps)
    assert [r.output for r in reqs] == [alone(model, p) for p in ps]
    assert events and all(e.waited for e in events)


def test_prefix_cache_changes_no_token_and_saves_prefill(model):
    shared = prompts([70], seed=2)[0]
    ps = prompts([4, 9, 1, 13], seed=3, prefix=shared)
    ps += [ps[0]]  # the same prompt again: its state and logits are cached whole
    without = [r.output for r in run(Engine(model, ByteTokenizer(), prefix_cache_bytes=0), ps)]
    engine = Engine(model, ByteTokenizer(), max_batch=1, prefill_chunk=32, prefix_cache_bytes=1 << 20,
                    prefix_min_tokens=16)
    with_cache = [r.output for r in run(engine, ps)]
    assert with_cache == without == [alone(model, p) for p in ps]
    s = engine.stats
    # 1st: nothing cached; 2nd: parts from the 1st at 70 tokens (that state is kept); 3rd, 4th:
    # start at 70; 5th: the 1st prompt whole
    assert s.cache_hits == 3 and s.cache_tokens == 70 + 70 + len(ps[0])
    assert s.prefill_tokens == sum(map(len, ps)) - s.cache_tokens


def test_prefix_cache_is_bounded_in_bytes_lru():
    cache = PrefixCache(max_bytes=3 * 400, min_tokens=2)
    state = [(torch.zeros(1, 50),)]  # 200 bytes + 200 bytes of logits = 400 a entry
    logits = torch.zeros(50)
    for n in range(2, 6):
        cache.put(np.arange(n), state, logits)
    assert [len(e.tokens) for e in cache.entries.values()] == [3, 4, 5] and cache.bytes == 1200
    assert len(cache.lookup(np.arange(10)).tokens) == 5  # the longest stored prefix
    assert len(cache.lookup(np.arange(3)).tokens) == 3 and cache.lookup(np.array([1, 2])) is None
    cache.put(np.arange(7), state, logits)  # evicts the least recently used: 4 tokens
    assert sorted(len(e.tokens) for e in cache.entries.values()) == [3, 5, 7]
    assert cache.boundary(np.array([9, 9, 9, 1]), 0) is None  # nothing shared
    assert cache.boundary(np.array([9, 9, 9, 2, 5]), 0) == 3  # parts from the one before after 3
    assert cache.boundary(np.array([9, 9, 9, 2, 6]), 4) is None  # 4 tokens already cached
    assert PrefixCache(0).lookup(np.arange(3)) is None


def test_cancel_frees_the_slot_at_once(model):
    engine = Engine(model, ByteTokenizer(), max_batch=1, prefix_cache_bytes=0).start()
    try:
        long = Request([1, 2, 3], SamplingParams(max_tokens=10**6, temperature=0), stream=True)
        engine.submit([long])
        while len(long.output) < 3:
            long.done.wait(0.01)
        short = Request([4, 5], GREEDY)
        engine.submit([short])
        assert not short.done.wait(0.3)  # the only slot is taken
        engine.cancel(long)
        assert short.done.wait(30) and long.done.is_set()
    finally:
        engine.close()
        engine.join(30)
    assert long.finish_reason == "cancelled" and 3 <= len(long.output) < 10**6
    assert short.finish_reason == "length" and short.output == alone(model, [4, 5])
    assert engine.running == 0


class EndAt(ByteTokenizer):
    def __init__(self, eos):
        self.eos_token_id = eos


def test_end_token_and_stop_strings_end_requests(model):
    p = prompts([10], seed=5)[0]
    free = alone(model, p, 12)
    eos = free[4]
    reqs = run(Engine(model, EndAt(eos), prefix_cache_bytes=0), [p, p],
               SamplingParams(max_tokens=12, temperature=0))
    assert reqs[0].finish_reason == "stop" and reqs[0].output == free[:free.index(eos) + 1]
    ignoring = run(Engine(model, EndAt(eos), prefix_cache_bytes=0), [p],
                   SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert ignoring.finish_reason == "length" and ignoring.output == free
    # a stop string: the text is cut before it, exactly as complete_texts cuts it
    text = bytes(free).decode("utf-8", errors="replace")
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    tok = ByteTokenizer()
    r = run(Engine(model, tok, prefix_cache_bytes=0), [p], SamplingParams(max_tokens=12, temperature=0,
                                                                            stop=(stop,)))[0]
    assert r.finish_reason == "stop" and r.text == text[:text.index(stop)] and stop not in r.text


def test_seeded_and_grouped_sampling(model):
    p = prompts([6], seed=4)[0]
    seeded = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5)
    a, b = run(Engine(model, ByteTokenizer(), prefix_cache_bytes=0), [p, p], seeded)
    ref = model.generate(torch.tensor(p), max_new_tokens=10, temperature=0.8, top_p=0.9, seed=5)[6:].tolist()
    assert a.output == b.output == ref
    # unseeded requests of equal settings are sampled together; top_k=1 leaves only the argmax
    reqs = run(Engine(model, ByteTokenizer(), prefix_cache_bytes=0), prompts([3, 8, 5]),
               SamplingParams(max_tokens=10, temperature=1.5, top_k=1))
    assert [r.output for r in reqs] == [alone(model, q, 10) for q in prompts([3, 8, 5])]


def test_a_failing_step_ends_the_running_requests_with_an_error_and_the_engine_goes_on(model, monkeypatch):
    engine = Engine(model, ByteTokenizer(), max_batch=4, prefix_cache_bytes=0).start()
    try:
        real = engine.step.eager
        calls = {"n": 0}

        def flaky(b):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("device lost")
            return real(b)

        monkeypatch.setattr(engine.step, "eager", flaky)
        failed = engine.generate(prompts([3, 4]), GREEDY)
        assert [r.finish_reason for r in failed] == ["error", "error"] and "device lost" in failed[0].error
        ok = engine.generate(prompts([5]), GREEDY)[0]
        assert ok.finish_reason == "length" and ok.output == alone(model, prompts([5])[0])
    finally:
        engine.close()
        engine.join(30)


def test_queue_bound_and_shutdown(model):
    engine = Engine(model, ByteTokenizer(), max_batch=1, max_queue=1, prefix_cache_bytes=0).start()
    long = SamplingParams(max_tokens=10**6, temperature=0)
    first, second = Request([1], long), Request([2], long)
    engine.submit([first])
    while not first.output:
        first.done.wait(0.01)
    engine.submit([second])
    with pytest.raises(EngineBusy):
        engine.submit([Request([3], long)])
    engine.close(grace=0.2)
    with pytest.raises(EngineClosed):
        engine.submit([Request([3], GREEDY)])
    engine.join(30)
    assert first.finish_reason == second.finish_reason == "shutdown"
    assert first.output and not second.output


def test_requests_that_end_within_the_grace_period_finish_normally(model):
    engine = Engine(model, ByteTokenizer(), prefix_cache_bytes=0).start()
    r = Request([7, 8, 9], SamplingParams(max_tokens=40, temperature=0))
    engine.submit([r])
    engine.close(grace=60)
    engine.join(60)
    assert r.finish_reason == "length" and r.output == alone(model, [7, 8, 9], 40)


def test_bad_prompts_are_refused_at_submit(model):
    engine = Engine(model, ByteTokenizer())
    for bad in ([], [1, 256], [-1]):
        with pytest.raises(XLSTMKitError, match="token ids in \\[0, 256\\)"):
            engine.submit([Request(bad, GREEDY)])
    with pytest.raises(XLSTMKitError, match="temperature"):
        engine.submit([Request([1], SamplingParams(temperature=-1))])


def test_batch_buckets():
    assert _buckets(1) == [1] and _buckets(8) == [1, 2, 4, 8] and _buckets(12) == [1, 2, 4, 8, 12]


def test_a_compiled_prefill_gives_the_tokens_of_generate_alone():
    """With compile_prefill (xlstm-kit serve --compile) the engine compiles the prompt reads as it
    starts, every piece length of its prompt reader: requests of other lengths, alone or continued
    from a cached prefix, compile nothing more, and each gets the tokens `generate` gives its
    prompt alone with the same compiled reads (compiled and eager logits may differ in the last
    bits, which can flip a greedy choice of a random model)."""
    m = tiny_model()
    ps = prompts([3, 9, 20, 45], seed=4)
    m.compile_prefill(backend="eager")
    torch._dynamo.reset()
    engine = Engine(m, ByteTokenizer(), max_batch=4, prefix_cache_bytes=1 << 20, prefix_min_tokens=4).start()
    try:
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0  # compiled at start, before any request
        reqs = [engine.generate([p], GREEDY)[0] for p in ps]  # one at a time: the compiled reads
        again = engine.generate([ps[3] + [7, 8, 9]], GREEDY)[0]  # its prefix from the cache
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        engine.close()
        engine.join(30)
    assert [r.output for r in reqs] == [alone(m, p) for p in ps]
    assert again.cached_tokens == len(ps[3]) and again.output == alone(m, ps[3] + [7, 8, 9])


def test_requests_wait_for_a_prompt_readers_row(model, monkeypatch):
    """More slots than the prompt reader's rows: requests queue for a row, every one still gets
    the tokens of its prompt alone, and no more than the rows are being read at once."""
    import xlstm_kit.serve.engine as eng

    monkeypatch.setattr(eng, "READ_ROWS", 2)
    ps = prompts([30, 5, 17, 1, 44, 9, 23, 2], seed=5)
    engine = Engine(model, ByteTokenizer(), max_batch=6, prefill_chunk=8, prefix_cache_bytes=0)
    seen = []
    admit = engine._admit

    def watched(updates):
        admit(updates)
        seen.append(len(engine.prefilling))

    engine._admit = watched
    reqs = run(engine, ps)
    assert max(seen) == 2 and len(engine._free_rows) == 2
    assert [r.output for r in reqs] == [alone(model, p) for p in ps]


def test_prompts_read_in_padded_pieces_as_on_a_gpu_give_the_tokens_of_generate_alone(model, monkeypatch):
    """On a GPU the engine's reader reads padded pieces (its CUDA graphs' shapes); on the CPU it
    reads at once. Forced into pieces here: chunked prompts, several requests per read, prefix
    cache hits and boundaries, and reads of 1-2 tokens as decode steps."""
    import xlstm_kit.serve.engine as eng

    real, made = eng.PromptReader, []

    def pieces_reader(*a, **k):
        made.append(real(*a, pieces=True, **k))
        return made[-1]

    monkeypatch.setattr(eng, "PromptReader", pieces_reader)
    shared = prompts([40], seed=5)[0]
    ps = prompts([1, 40, 7, 23, 2, 60], seed=6) + prompts([4, 1, 13], seed=7, prefix=shared)
    ps += [ps[-1] + [7], ps[-1] + [7, 8]]  # cached up to their last one or two tokens
    engine = Engine(model, ByteTokenizer(), max_batch=4, prefill_chunk=16, prefix_cache_bytes=1 << 22,
                    prefix_min_tokens=16)
    got = [r.output for r in run(engine, ps)]
    reader = made[-1]
    assert reader.padded and reader.step_lengths == [1, 2] and reader.replays > 0
    assert engine.stats.cache_hits >= 3
    assert got == [alone(model, p) for p in ps]


def test_requests_that_arrive_together_read_their_shared_prefix_once(model):
    """Six requests with one 70-token system prompt, submitted together: the second finds the
    boundary it shares with the first, which then stores its state there; the other five wait
    for that state instead of reading the same 70 tokens alongside."""
    shared = prompts([70], seed=8)[0]
    questions = [3, 9, 1, 13, 5, 6]
    ps = prompts(questions, seed=9, prefix=shared)
    engine = Engine(model, ByteTokenizer(), max_batch=8, prefill_chunk=32, prefix_cache_bytes=1 << 22,
                    prefix_min_tokens=16)
    got = [r.output for r in run(engine, ps)]
    assert got == [alone(model, p) for p in ps]
    s = engine.stats
    assert s.prefill_tokens == 70 + sum(questions)
    assert s.cache_hits == 5 and s.cache_tokens == 5 * 70
    # a cache too small for one state: nobody waits for a state that cannot be kept
    small = Engine(model, ByteTokenizer(), max_batch=8, prefill_chunk=32, prefix_cache_bytes=1024,
                   prefix_min_tokens=16)
    assert [r.output for r in run(small, ps)] == got
    assert small.stats.prefill_tokens == sum(map(len, ps))
