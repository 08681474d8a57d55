"""The lm-eval backend ``xlstm_kit`` on the local tasks of tests/eval/tasks (multiple choice,
rolling perplexity, generate_until): its numbers equal a direct computation with the model
(log-likelihoods to 1e-5 in float32, greedy continuations token for token), and lm-eval's own
``hf`` backend over transformers' xLSTMForCausalLM gives the same numbers on the same folder.

The hf backend's settings per comparison: with transformers 5 the folder's tokenizer adds no BOS
unless told (add_bos_token=True), and with it lm-eval's perplexity windows would carry two
(the text's and the window prefix); so the contexts of multiple choice and generation are
compared with add_bos_token=True, perplexity without. Its generation runs one prompt per batch:
a batch is padded on the left, and the padding would enter the recurrent state.
"""
from __future__ import annotations

import math

import pytest
import torch

from xlstm_kit import XLSTMLanguageModel

from .conftest import TASKS

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
from xlstm_kit.evaluation import lm_eval_backend  # noqa: E402  (needs lm_eval)
from xlstm_kit.evaluation.lm_eval_backend import XLSTMKitLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny shapes (see tests/conftest.py)

ALL = ["xk_choice", "xk_rolling", "xk_generate"]
STOPS = ["\n\n", "e"]  # xk_generate.yaml's until
MAX_GEN = 12  # xk_generate.yaml's max_gen_toks


class Req:
    """What generate_until reads of an lm-eval Instance."""

    def __init__(self, *args):
        self.args = args


def evaluate(model, tasks, model_args=None, **kw):
    """lm_eval.simple_evaluate from tasks/ (their data paths are relative), HF datasets offline,
    the local tasks only (lm-eval's own 14,000 are not indexed)."""
    from lm_eval.tasks import TaskManager

    datasets_config = pytest.importorskip("datasets.config")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets_config, "HF_DATASETS_OFFLINE", True)
        mp.setattr(datasets_config, "HF_HUB_OFFLINE", True, raising=False)
        mp.chdir(TASKS)
        manager = TaskManager(include_path=str(TASKS), include_defaults=False)
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=manager,
                                       log_samples=True, device="cpu", **kw)


def samples(results, task):
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def model(hf_folder):
    return XLSTMLanguageModel.from_pretrained(hf_folder).eval()


@pytest.fixture(scope="module")
def ours(hf_folder):
    """Our backend on all three tasks, every generated row's tokens recorded."""
    recorded = []
    real = lm_eval_backend.generate

    def recording(model, rows, *a, **kw):
        out = real(model, rows, *a, **kw)
        recorded.extend((r.tolist(), o[len(r):].tolist()) for r, o in zip(rows, out))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_eval_backend, "generate", recording)
        results = evaluate(XLSTMKitLM(pretrained=str(hf_folder), dtype="float32", batch_size=64), ALL)
    return results, recorded


def logprob_of(model, ids: list[int], start: int) -> tuple[float, bool]:
    """Direct: sum of log p(ids[t] | ids[:t]) for t >= start from one forward, and whether each of
    those tokens is the argmax."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor(ids)[None, :-1])[0].double(), -1)
    targets = torch.tensor(ids[start:])
    rows = logp[start - 1:]
    return rows.gather(1, targets[:, None]).sum().item(), bool((rows.argmax(-1) == targets).all())


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def test_multiple_choice_equals_the_direct_log_likelihoods(ours, model):
    results, _ = ours
    tok = model.tokenizer
    docs = samples(results, "xk_choice")
    assert len(docs) == 6 and sum(len(s["arguments"]) for s in docs) == 23
    correct = 0
    for s in docs:
        direct = []
        for (context, continuation), ((got, greedy),) in zip(s["arguments"], s["resps"]):
            ctx = tok.encode(context)  # the BOS token first: the model expects it
            assert ctx[0] == 0
            ref, ref_greedy = logprob_of(model, tok.encode(context + continuation), len(ctx))
            assert close(got, ref), (context, continuation, got, ref)
            assert greedy == ref_greedy
            direct.append(ref)
        correct += max(range(len(direct)), key=direct.__getitem__) == s["doc"]["answer"]
    assert results["results"]["xk_choice"]["acc,none"] == pytest.approx(correct / len(docs))


def test_rolling_perplexity_equals_the_direct_log_likelihood_with_one_bos(ours, model):
    results, _ = ours
    tok = model.tokenizer
    docs = samples(results, "xk_rolling")
    assert len(docs) == 3
    total_ll = total_bytes = 0.0
    for s in docs:
        text = s["doc"]["text"]
        ids = tok.encode(text)  # [BOS, text...]: one BOS, the window's prefix
        assert ids[0] == 0 and ids[1] != 0
        ref, _ = logprob_of(model, ids, 1)
        assert close(s["resps"][0][0], ref), (s["resps"], ref)
        total_ll += ref
        total_bytes += len(text.encode("utf-8"))
    bpb = results["results"]["xk_rolling"]["bits_per_byte,none"]
    assert bpb == pytest.approx(-total_ll / total_bytes / math.log(2), rel=1e-6)


def test_generate_until_equals_greedy_decoding_token_for_token(ours, model):
    results, recorded = ours
    tok = model.tokenizer
    docs = samples(results, "xk_generate")
    assert len(docs) == len(recorded) == 4
    by_prompt = dict((tuple(p), new) for p, new in recorded)
    stopped = 0
    for s in docs:
        ids = tok.encode(s["doc"]["prompt"])
        new = []
        with torch.no_grad():  # greedy from full forwards, no recurrent state carried
            for _ in range(MAX_GEN):
                nxt = int(model(torch.tensor(ids + new)[None])[0, -1].argmax())
                if nxt == tok.eos_token_id:
                    break
                new.append(nxt)
        got = by_prompt[tuple(ids)]
        assert got == new[: len(got)], (got, new)  # token for token, up to where the backend stopped
        text = tok.decode(new)
        cut = min([text.index(x) for x in STOPS if x in text], default=None)
        if cut is None:
            assert len(got) == MAX_GEN
        else:  # the backend stopped at the token that completed a stop string
            stopped += 1
            assert any(x in tok.decode(got) for x in STOPS) and not any(x in tok.decode(got[:-1]) for x in STOPS)
        assert s["resps"][0][0] == text[:cut]
    assert 0 < stopped < len(docs)  # the task exercises both ends: a stop string and the token limit


def test_contexts_carry_the_bos_token_and_shared_contexts_are_read_once(hf_folder, model):
    lm = XLSTMKitLM(pretrained=model, batch_size=64)
    assert lm.add_bos_token and lm.prefix_token_id == 0
    row = sum(t.numel() * t.element_size() for s in model.init_state(1) for t in s)
    assert XLSTMKitLM(pretrained=model, state_memory_gib=3.5 * row / 2**30).max_batch_rows == 3
    assert lm.tok_encode("To be")[0] == 0 and lm.tok_encode("To be", add_special_tokens=False)[0] != 0
    assert lm.tok_encode("<|endoftext|>To be")[:2] != [0, 0]  # a text that starts with BOS keeps one
    seen = []
    real_forward = model.forward

    def counting(tokens, *a, **kw):
        seen.append((tokens.shape, kw.get("cu_seqlens") is not None))
        return real_forward(tokens, *a, **kw)

    ctx, choices = "Question: Who wrote Hamlet?\nAnswer:", [" Marlowe", " Shakespeare", " Jonson"]
    reqs = [((ctx, c), *lm._encode_pair(ctx, c)) for c in choices]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "forward", counting)
        lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    n_ctx = len(reqs[0][1])
    # one packed call reads the context once, one more the continuations beyond their first token
    assert seen[0] == (torch.Size([1, n_ctx]), True)
    assert len(seen) == 2 and all(packed for _, packed in seen)
    assert sum(shape[1] for shape, _ in seen) == n_ctx + sum(len(r[2]) - 1 for r in reqs)


def test_a_run_folder_by_name_through_lm_evals_registry(run_folder, in_tasks):
    """`model="xlstm_kit"` with model_args as on the lm_eval command line; the byte tokenizer of
    the run has no BOS: contexts are their bytes, a perplexity window starts from a newline."""
    results = evaluate("xlstm_kit", ["xk_choice", "xk_rolling"], model_args=f"pretrained={run_folder},batch_size=4",
                       limit=2)
    model = XLSTMLanguageModel.from_pretrained(run_folder).eval()
    assert model.tokenizer.name == "byte"
    for s in samples(results, "xk_choice"):
        for (context, continuation), ((got, _),) in zip(s["arguments"], s["resps"]):
            ref, _ = logprob_of(model, list((context + continuation).encode()), len(context.encode()))
            assert close(got, ref)
    for s in samples(results, "xk_rolling"):
        ref, _ = logprob_of(model, [10, *s["doc"]["text"].encode()], 1)
        assert close(s["resps"][0][0], ref)
    # an empty prompt starts from the same newline
    lm = XLSTMKitLM(pretrained=model)
    want = model.generate(torch.tensor([10]), max_new_tokens=4, temperature=0)[1:].tolist()
    assert lm.generate_until([Req("", {"until": ["\x00"], "max_gen_toks": 4})], disable_tqdm=True) == [bytes(want).decode(
        "utf-8", errors="replace")]


@pytest.fixture(scope="module")
def hf_results(hf_folder):
    args = f"pretrained={hf_folder},dtype=float32"
    return (evaluate("hf", ["xk_choice", "xk_generate"], model_args=args + ",add_bos_token=True", batch_size=1),
            evaluate("hf", ["xk_rolling"], model_args=args + ",max_length=40", batch_size=1))


def test_lm_evals_hf_backend_gives_the_same_numbers(ours, hf_results, hf_folder):
    results, _ = ours
    hf_main, hf_rolling = hf_results
    for task in ("xk_choice", "xk_generate"):
        for a, b in zip(samples(results, task), samples(hf_main, task), strict=True):
            for (x,), (y,) in zip(a["resps"], b["resps"], strict=True):
                if task == "xk_choice":
                    assert close(x[0], y[0]) and x[1] == y[1], (x, y)
                else:
                    assert x == y
    assert results["results"]["xk_choice"]["acc,none"] == hf_main["results"]["xk_choice"]["acc,none"]
    # perplexity over windows of 40 tokens (the texts have up to ~90): lm-eval's windows, both ways
    windows = evaluate(XLSTMKitLM(pretrained=str(hf_folder), dtype="float32", max_length=40), ["xk_rolling"])
    for a, b in zip(samples(windows, "xk_rolling"), samples(hf_rolling, "xk_rolling"), strict=True):
        assert close(a["resps"][0][0], b["resps"][0][0])
    whole = {s["doc_id"]: s["resps"][0][0] for s in samples(results, "xk_rolling")}
    assert any(not close(s["resps"][0][0], whole[s["doc_id"]]) for s in samples(windows, "xk_rolling"))


def test_bad_model_args_and_generation_options_are_one_line_errors(model):
    from xlstm_kit.errors import XLSTMKitError

    with pytest.raises(XLSTMKitError, match="does not take temperature"):
        XLSTMKitLM(pretrained=model, temperature=0.5)
    with pytest.raises(XLSTMKitError, match="batch_size must be an integer >= 1"):
        XLSTMKitLM(pretrained=model, batch_size=0)
    with pytest.raises(XLSTMKitError, match="dtype must be one of"):
        XLSTMKitLM.create_from_arg_string("pretrained=x,dtype=float8")

    with pytest.raises(XLSTMKitError, match="num_beams not supported"):
        XLSTMKitLM(pretrained=model).generate_until([Req("Once", {"until": ["."], "num_beams": 4})], disable_tqdm=True)
