"""lm-eval multiple-choice requests per second: our backend ("xlstm_kit") against lm-eval's "hf"
backend over transformers' xLSTMForCausalLM, on the same weights.

    python3 benchmarks/lm_eval_speed.py [--preset 7b] [--requests 2000] [--out DIR]   (a GPU)
    python3 benchmarks/lm_eval_speed.py --quick                                       (CPU check)

The task is tests/eval/tasks/xk_choice scaled up: questions whose contexts are 200-2,000 tokens
of pseudo-words ("Question: ...\\nAnswer:"), 4 choices of 1-3 words each, so 2,000 requests are
500 contexts. The model has the preset's shapes (default "7b": NX-AI/xLSTM-7b's) and random
weights in --dtype (bf16); a byte-level BPE tokenizer learnt from the pseudo-words stands in for
the 7B's (BOS = EOS = 0, put before each context by both backends). transformers' model is built
on the meta device and handed our tensors, so both backends compute with the very same weights
(its config: pure-PyTorch kernels, as our save_pretrained writes and a plain transformers install
runs).

Each backend's `loglikelihood` gets the same lm-eval Instances: a warm-up on the first 5 % (kernel
compilation, autotuning), then all of them, timed. Reported: requests/s of each, the speed-up
(target >= 3x), and how far the two backends' log-likelihoods and chosen answers agree (in bf16
they differ by rounding; --quick runs float32 and fails unless they agree to 1e-4; its timings
mean nothing: on the CPU the packed forward reads its sequences one at a time).

Writes DIR/lm_eval_speed.json and DIR/lm_eval_speed.md (DIR = --out, else $OUT, else .).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

BOS = 0


def pseudo_words(rng: random.Random, n: int) -> list[str]:
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "an", "el", "or", "um", "ba", "de", "fi", "go"]
    return ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def make_tokenizer(folder: Path, words: list[str], vocab: int) -> None:
    """A byte-level BPE tokenizer.json (any text encodes) learnt from the pseudo-words, with
    <|endoftext|> = 0 (BOS and EOS, as NX-AI/xLSTM-7b's)."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|pad|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    rng = random.Random(1)
    tok.train_from_iterator((" ".join(rng.choices(words, k=200)) for _ in range(2000)), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}))


def make_requests(tok, words: list[str], n_requests: int, choices: int, lo: int, hi: int, seed: int):
    """lm-eval Instances: n_requests // choices questions, contexts of lo..hi tokens."""
    from lm_eval.api.instance import Instance

    rng = random.Random(seed)
    out = []
    for q in range(n_requests // choices):
        want = rng.randint(lo, hi)
        ids = tok.encode(" ".join(rng.choices(words, k=want))).ids[:want]
        context = "Question: " + tok.decode(ids).strip() + "\nAnswer:"
        for c in range(choices):
            cont = " " + " ".join(rng.choices(words, k=rng.randint(1, 3)))
            out.append(Instance("loglikelihood", {}, (context, cont), idx=c, metadata=("bench", q, 1)))
    return out


def build_models(args, folder: Path):
    """Ours with random weights in args.dtype on args.device, and transformers' xLSTMForCausalLM
    holding the very same tensors."""
    import torch
    import transformers

    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
    from xlstm_kit.io.hf import config_to_hf, our_key_to_hf
    from xlstm_kit.io.tokenizers import HFSpecialTokens

    dtype = getattr(torch, args.dtype)
    if args.quick:
        cfg = XLSTMConfig(family="large", vocab_size=args.vocab, d_model=64, n_blocks=2, n_heads=2,
                          qk_dim_factor=1.0, v_dim_factor=1.0, ffn_proj_factor=1.5, round_proj_to=16)
    else:
        cfg = XLSTMConfig.from_name(args.preset)
    torch.manual_seed(0)
    with torch.device(args.device):  # a 7B model initialises in seconds there, in minutes on the CPU
        ours = XLSTMLanguageModel(cfg)
    ours = ours.to(dtype).eval()
    hf_cfg = config_to_hf(cfg, HFSpecialTokens(BOS, BOS, None), dtype)
    # config.json beside the tokenizer files: transformers picks the xLSTM tokenizer class from it
    (folder / "config.json").write_text(json.dumps(hf_cfg))
    with torch.device("meta"):
        hf = transformers.xLSTMForCausalLM(transformers.xLSTMConfig(**hf_cfg))
    state = {our_key_to_hf(k): v for k, v in ours.state_dict().items()}
    hf.load_state_dict(state, strict=True, assign=True)  # the same tensors: no second copy
    return ours, hf.eval()


def timed(fn, device: str) -> tuple[object, float]:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="7b", help="model shapes (default: 7b, NX-AI/xLSTM-7b's)")
    p.add_argument("--requests", type=int, default=2000, help="loglikelihood requests (--choices per question)")
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--min-tokens", type=int, default=200, help="shortest context, in tokens")
    p.add_argument("--max-tokens", type=int, default=2000, help="longest context, in tokens")
    p.add_argument("--batch-size", default="auto",
                   help="ours: requests per packed forward (default: as many as the token and state budgets allow)")
    p.add_argument("--max-batch-tokens", type=int, default=32768, help="ours: tokens per packed forward")
    p.add_argument("--hf-batch-size", type=int, default=8, help="hf backend: requests per padded batch")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=50304, help="the tokenizer's vocabulary (at most the model's)")
    p.add_argument("--skip-hf", action="store_true", help="time our backend only")
    p.add_argument("--quick", action="store_true",
                   help="CPU check: a tiny model, 32 requests of 16-48 tokens, float32; fails unless both agree "
                   "(its timings say nothing: on the CPU our packed forward reads the sequences one by one)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.device, args.dtype, args.requests, args.min_tokens, args.max_tokens = "cpu", "float32", 32, 16, 48
        args.vocab, args.hf_batch_size, args.batch_size = 512, 4, "8"
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)

    import torch
    from lm_eval.models.huggingface import HFLM

    from xlstm_kit.evaluation.lm_eval_backend import XLSTMKitLM
    from xlstm_kit.io.tokenizers import HFTokenizer

    words = pseudo_words(random.Random(0), 3000)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_tokenizer(folder, words, args.vocab)
        ours_model, hf_model = build_models(args, folder)
        ours_tok = HFTokenizer(folder / "tokenizer.json", bos_token_id=BOS, eos_token_id=BOS)
        import tokenizers

        plain = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        requests = make_requests(plain, words, args.requests, args.choices, args.min_tokens, args.max_tokens, seed=1)
        ours = XLSTMKitLM(pretrained=ours_model, tokenizer=ours_tok, batch_size=args.batch_size,
                          max_batch_tokens=args.max_batch_tokens)
        backends = {"xlstm_kit": ours}
        if not args.skip_hf:
            import transformers

            hf_tok = transformers.AutoTokenizer.from_pretrained(folder, add_bos_token=True)
            backends["hf"] = HFLM(pretrained=hf_model, tokenizer=hf_tok, batch_size=args.hf_batch_size,
                                  add_bos_token=True, max_length=4096)
        n_questions = len(requests) // args.choices
        n_ctx = sum(len(ours.tok_encode(r.args[0])) for r in requests[:: args.choices])
        warm = requests[: max(1, n_questions // 20) * args.choices]
        rows, answers = [], {}
        for name, lm in backends.items():
            with torch.no_grad():
                timed(lambda: lm.loglikelihood(warm, disable_tqdm=True), args.device)
                res, seconds = timed(lambda: lm.loglikelihood(requests, disable_tqdm=True), args.device)
            answers[name] = [ll for ll, _ in res]
            rows.append({"backend": name, "requests": len(requests), "seconds": round(seconds, 3),
                         "requests_per_s": round(len(requests) / seconds, 2)})
            print(f"{name}: {len(requests)} requests in {seconds:.2f} s = {len(requests) / seconds:.1f}/s", flush=True)

    summary = {"preset": "quick" if args.quick else args.preset, "dtype": args.dtype, "device": args.device,
               "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
               "requests": len(requests), "questions": n_questions, "context_tokens_mean": round(n_ctx / n_questions),
               "batch_size": args.batch_size, "max_batch_tokens": args.max_batch_tokens,
               "hf_batch_size": args.hf_batch_size, "rows": rows}
    if "hf" in answers:
        a, b = answers["xlstm_kit"], answers["hf"]
        diff = max(abs(x - y) for x, y in zip(a, b))

        def pick(v, q):
            return max(range(args.choices), key=lambda c: v[q * args.choices + c])

        same = sum(pick(a, q) == pick(b, q) for q in range(n_questions)) / n_questions
        summary.update(speedup=round(rows[1]["seconds"] / rows[0]["seconds"], 2), max_abs_logprob_diff=diff,
                       same_answer_share=same)
        print(f"speed-up {summary['speedup']}x; log-likelihoods differ by at most {diff:.3g}; "
              f"same answer for {same:.1%} of the questions", flush=True)
    (out_dir / "lm_eval_speed.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [f"# lm-eval multiple choice: {summary['requests']} requests, {n_questions} contexts of "
             f"{args.min_tokens}-{args.max_tokens} tokens (mean {summary['context_tokens_mean']}), {args.dtype}, "
             f"{summary['gpu'] or args.device}, preset {summary['preset']}", "",
             "| backend | requests/s | seconds |", "| --- | ---: | ---: |"]
    lines += [f"| {r['backend']} | {r['requests_per_s']} | {r['seconds']} |" for r in rows]
    if "speedup" in summary:
        lines += ["", f"speed-up {summary['speedup']}x; max |log-likelihood difference| "
                      f"{summary['max_abs_logprob_diff']:.3g}; same answer {summary['same_answer_share']:.1%}"]
    (out_dir / "lm_eval_speed.md").write_text("\n".join(lines) + "\n")
    if args.quick and "hf" in answers and not (summary["max_abs_logprob_diff"] < 1e-4
                                               and summary["same_answer_share"] == 1):
        print("the backends disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
