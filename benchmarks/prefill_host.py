"""Where one prompt's read spends its time on the host: launch-only time (no sync) against the
read with the device synchronised, the Python functions by own time (cProfile) and the
operators by host time (torch.profiler), eager and after `compile_prefill`.

    python3 benchmarks/prefill_host.py [--model 125M] [--length 128] [--out DIR]

A preset's random weights, bf16, on CUDA. Writes prefill_host.md (and prints it).
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="125M", help="a preset name")
    ap.add_argument("--length", type=int, default=128, help="prompt tokens")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder")
    args = ap.parse_args()

    import torch
    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
    from xlstm_kit.generation.generate import _prefill

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = XLSTMLanguageModel(XLSTMConfig.from_name(args.model)).to(torch.bfloat16).eval()
    prompt = [torch.randint(0, 50257, (args.length,), device="cuda")]
    lines = [f"# prefill_host: {args.model}, {args.length} tokens, {torch.cuda.get_device_name()}", ""]
    for compiled in (False, True):
        if compiled:
            model.compile_prefill()
        tag = "compiled" if compiled else "eager"
        with torch.no_grad():
            for _ in range(3):
                _prefill(model, prompt)
            torch.cuda.synchronize()
            launch, total = [], []
            for _ in range(10):
                t = time.perf_counter()
                _prefill(model, prompt)
                launch.append((time.perf_counter() - t) * 1e3)
                torch.cuda.synchronize()
                total.append((time.perf_counter() - t) * 1e3)
            lines += [f"## {tag}", "", f"- host until return {statistics.median(launch):.1f} ms, "
                      f"with the device synchronised {statistics.median(total):.1f} ms", ""]
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                _prefill(model, prompt)
            torch.cuda.synchronize()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            lines += ["cProfile, 5 reads, by own time:", "", "```", s.getvalue()[-9000:], "```", ""]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as p:
                _prefill(model, prompt)
                torch.cuda.synchronize()
            ev = p.key_averages()
            kernels = sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
            gpu_us = sum(e.self_device_time_total for e in ev)
            lines += [f"- one read: {kernels} kernels, {gpu_us / 1e3:.1f} ms of kernel time", "", "```",
                      ev.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60), "```", ""]
    text = "\n".join(lines)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefill_host.md"), "w") as f:
        f.write(text)
    print(text[:20000])


if __name__ == "__main__":
    main()
