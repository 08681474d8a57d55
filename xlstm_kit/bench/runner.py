"""Run the registered cases, optionally against the peers, and write one dated markdown table.

    xlstm-kit bench [--suite ops|model|generate|all] [--peers [--peer-timeout S]] [--out DIR] [--quick]
                    [--case NAME ...] [--device DEV] [--backend torch|triton] [--threads N] [--list]

Ours run in this process; each peer measurement runs in a child process of the same call (same
machine state), so the ratio column compares like with like. The file is
`DIR/YYYY-MM-DD-<machine>-<suite>.md` (a numbered suffix rather than overwriting), headed by the
date, machine, library versions and the exact command; the table is also printed.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence, TextIO

import torch

from .._version import __version__
from ..errors import XLSTMKitError
from ..io.paths import check_writable
from . import peers as peer_mod, registry, timing
from .options import PEER_TIMEOUT_S, SUITE_CHOICES, add_arguments
from .registry import SUITES, Env


@dataclass
class Row:
    case: str
    impl: str
    shape: dict
    dtype: str
    result: dict = field(default_factory=dict)  # timing.measure_case keys, or {"status": reason}
    work: registry.Work = registry.Work()
    ours_ms: float | None = None  # our time in the same mode, on peer rows (for the ratio)


# ------------------------------------------------------------------------------ environment
def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            m = re.search(r"^model name\s*:\s*(.+)$", fh.read(), re.M)
            cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs"


def machine_slug(device: torch.device) -> str:
    """Short lower-case name for the file: the GPU model (h200, a100, ...) or "cpu"."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    m = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", name.replace("nvidia", ""))
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def versions() -> str:
    parts = [f"xlstm_kit {__version__}", f"torch {torch.__version__}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        parts.append("triton not installed")
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)


def git_commit() -> str | None:
    """The commit of the checkout that holds the imported xlstm_kit, if it is one."""
    root = Path(__file__).resolve().parents[2]
    try:
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    return r.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def default_out_dir(cwd: Path | None = None) -> Path:
    """`benchmarks/results/` when run from the root of a clone, else the current folder."""
    cwd = Path.cwd() if cwd is None else cwd
    results = cwd / "benchmarks" / "results"
    if results.is_dir() and (cwd / "pyproject.toml").is_file():
        return results
    return cwd


def device_limits(device: torch.device) -> str | None:
    """The GPU's measured ceilings (bf16 matmul rate, copy bandwidth), to read the rates against;
    None on the CPU."""
    if device.type != "cuda":
        return None
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    mm = timing.measure(lambda: a @ b, device).median_ms
    x = torch.empty(2**29, device=device, dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    cp = timing.measure(lambda: y.copy_(x), device).median_ms
    del a, b, x, y
    torch.cuda.empty_cache()
    return (f"bf16 matmul {2 * n**3 / mm / 1e9:.0f} TFLOP/s, device copy "
            f"{2 * 2**29 * 2 / cp / 1e9:.0f} GB/s (measured in this call)")


# ------------------------------------------------------------------------------ measuring
def _ok(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def run_case(case: registry.Case, shape: dict, env: Env, quick: bool) -> dict:
    try:
        return _measure_ours(case, shape, env, quick)
    except torch.cuda.OutOfMemoryError:
        return {"status": "out of memory"}
    except Exception as e:  # noqa: BLE001 - one failing case must not stop the table
        return {"status": f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    finally:
        # the case's tensors are gone once _measure_ours returns: give their memory back to the
        # device before the next case, and before a peer's child process needs it
        if env.device.type == "cuda":
            torch.cuda.empty_cache()


def _measure_ours(case: registry.Case, shape: dict, env: Env, quick: bool) -> dict:
    timed = case.build(shape, env)
    budget = timing.QUICK if quick else timing.Budget()
    return timing.measure_case(timed.fwd, timed.fwbw, env.device, budget, flush_cache=case.suite == "ops")


def main_ms(result: dict) -> float | None:
    """Time of the main mode: fwd+bwd when there is one, else the single timed call."""
    return result.get("fwbw_ms", result.get("fwd_ms"))


def collect(selected: Sequence[registry.Case], env_of, quick: bool, with_peers: bool,
            log: TextIO | None = None, peer_timeout_s: float = PEER_TIMEOUT_S) -> list[Row]:
    rows: list[Row] = []
    for case in selected:
        env: Env = env_of(case)
        dtype = str(env.dtype).split(".")[-1]
        for shape in case.shapes(env.device, quick):
            t0 = time.perf_counter()
            impl = "xlstm_kit" + (f" ({env.backend})" if env.backend and case.takes_backend else "")
            ours = Row(case.name, impl, shape, dtype, run_case(case, shape, env, quick), case.work(shape, env))
            rows.append(ours)
            if log:
                print(f"# {case.name} {registry.shape_label(shape)}: {_brief(ours.result)} "
                      f"({time.perf_counter() - t0:.1f} s)", file=log, flush=True)
            if not with_peers:
                continue
            for peer in peer_mod.applicable(case, env.device):
                t0 = time.perf_counter()
                res = peer_mod.time_peer(peer, case, shape, env, quick, peer_timeout_s)
                rows.append(Row(case.name, peer.label, shape, dtype, res, ours.work, main_ms(ours.result)))
                if log:
                    print(f"#   {peer.label}: {_brief(res)} ({time.perf_counter() - t0:.1f} s)", file=log, flush=True)
    return rows


def _brief(res: dict) -> str:
    if "status" in res:
        return res["status"]
    return f"{main_ms(res):.3f} ms"


# ------------------------------------------------------------------------------ the table
def _f(x, digits=3) -> str:
    """Milliseconds and ratios: fixed decimals; thousands and up without them."""
    if x is None:
        return "–"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _g(x) -> str:
    """Rates: three significant digits (a CPU smoke run and an H200 differ by 10^5)."""
    if x is None:
        return "–"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def format_table(suite: str, rows: Sequence[Row]) -> str:
    """One markdown table per suite. Ratio column: our time ÷ the peer's time in the same mode
    (< 1: ours is faster)."""
    if suite == "ops":
        head = ["case", "implementation", "shape", "dtype", "fwd ms", "fwd+bwd ms", "TFLOP/s", "GB/s",
                "peak MiB", "ours ÷ this"]
    else:
        head = ["case", "implementation", "shape", "dtype", "ms per call", "tokens/s", "TFLOP/s",
                "peak MiB", "ours ÷ this"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        res = r.result
        cells = [r.case, r.impl, registry.shape_label(r.shape), r.dtype]
        if "status" in res:
            cells += [res["status"]] + [""] * (len(head) - len(cells) - 1)
            lines.append("| " + " | ".join(cells) + " |")
            continue
        ms = main_ms(res)
        s = ms / 1e3 if _ok(ms) else None
        flops = r.work.flop / s / 1e12 if (s and r.work.flop) else None
        ratio = r.ours_ms / ms if (r.ours_ms and _ok(ms)) else None
        if suite == "ops":
            gbs = r.work.bytes / s / 1e9 if (s and r.work.bytes) else None
            cells += [_f(res.get("fwd_ms")), _f(res.get("fwbw_ms")), _g(flops), _g(gbs),
                      _f(res.get("peak_mib"), 0)]
        else:
            tok = r.work.tokens / s if (s and r.work.tokens) else None
            cells += [_f(ms, 2), _g(tok), _g(flops), _f(res.get("peak_mib"), 0)]
        cells.append(_f(ratio, 2) if ratio is not None else ("—" if r.ours_ms is None else "–"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(suites: Sequence[str], rows_by_suite: dict[str, list[Row]], device: torch.device,
           command: str, quick: bool, when: _dt.datetime, limits: str | None = None) -> str:
    threads = f", {torch.get_num_threads()} torch threads" if device.type != "cuda" else ""
    out = [f"# xlstm-kit bench: {', '.join(suites)} — {when:%Y-%m-%d %H:%M} UTC", "",
           f"- Machine: {machine_name(device)}{threads}" + (f"; {limits}" if limits else ""),
           f"- Software: {versions()}"]
    commit = git_commit()
    if commit:
        out.append(f"- Code: commit {commit}")
    out += [f"- Command: `{command}`",
            "- Method: " + ("`--quick`: tiny shapes, 1 warm-up and 2–3 timed calls (a smoke test, not a "
                            "measurement)" if quick else
                            "median of timed calls after warm-up (CUDA events, L2 flushed before each op call; "
                            "perf_counter on the CPU); fwd+bwd = one forward and `backward()` into leaf tensors; "
                            "peers in child processes of the same call"),
            "- Peak MiB (GPU): memory allocated by one call beyond what was allocated before it (inputs, "
            "weights and optimizer state excluded).",
            "- Rates: TFLOP/s and GB/s from the case's FLOP and byte counts (`xlstm_kit/bench/registry.py`), "
            "the same count for every implementation of a case. ours ÷ this: our time over the peer's (< 1: ours is faster).",
            ""]
    for suite in suites:
        out += [f"## {suite}", "", format_table(suite, rows_by_suite[suite]), ""]
    return "\n".join(out)


def output_path(out_dir: Path, device: torch.device, suite: str, when: _dt.datetime) -> Path:
    base = f"{when:%Y-%m-%d}-{machine_slug(device)}-{suite}"
    path, n = out_dir / f"{base}.md", 2
    while path.exists():
        path, n = out_dir / f"{base}-{n}.md", n + 1
    return path


# ------------------------------------------------------------------------------ entry points


def list_cases(suite: str | None, device: torch.device, stream: TextIO) -> None:
    for c in registry.cases(suite):
        print(f"{c.suite:8s} {c.name:16s} {c.doc}", file=stream)
        for s in c.shapes(device, quick=False):
            print(f"{'':26s}{registry.shape_label(s)}", file=stream)
        if c.peers:
            print(f"{'':26s}peers: {', '.join(c.peers)}", file=stream)


def command_line(args: argparse.Namespace, prog: str = "xlstm-kit bench") -> str:
    """The command that repeats this run (from the parsed options, so it is exact however the
    runner was called); --out is left out: where the table went does not change it."""
    parts = [prog, "--suite", args.suite]
    parts += ["--peers"] * bool(args.peers) + ["--quick"] * bool(args.quick)
    if args.peers and args.peer_timeout != PEER_TIMEOUT_S:
        parts += ["--peer-timeout", f"{args.peer_timeout:g}"]
    for name in args.case or ():
        parts += ["--case", name]
    for opt in ("device", "backend", "threads"):
        if getattr(args, opt):
            parts += [f"--{opt}", str(getattr(args, opt))]
    return " ".join(parts)


def run(args: argparse.Namespace, stdout: TextIO | None = None, stderr: TextIO | None = None) -> Path | None:
    """Run `xlstm-kit bench` with parsed `args`; returns the written file (None for --list).
    Raises XLSTMKitError (a ValueError) for an unknown suite or case, an unusable device, or
    when any of our own cases failed (after writing the table: the rows that ran are kept)."""
    if args.suite not in SUITE_CHOICES:
        raise XLSTMKitError(f"unknown benchmark suite {args.suite!r}; choose one of {', '.join(SUITE_CHOICES)}")
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise XLSTMKitError(f"unknown device {args.device!r}; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise XLSTMKitError(f"--device {args.device}: the benchmarks run on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise XLSTMKitError("--device cuda, but PyTorch sees no CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise XLSTMKitError(f"--device {args.device}: there are {torch.cuda.device_count()} CUDA GPUs")
    most = 4 * (os.cpu_count() or 1)  # more only thrash, and torch crashes at 100,000
    if args.threads is not None and not 1 <= args.threads <= most:
        raise XLSTMKitError(f"--threads must be in [1, {most}], got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.list:
        list_cases(None if args.suite == "all" else args.suite, device, stdout or sys.stdout)
        return None
    selected = {s: registry.cases(s) for s in suites}
    if args.case:
        known = {c.name for c in registry.CASES}
        for name in args.case:
            if name not in known:
                raise XLSTMKitError(f"unknown benchmark case {name!r}; choose one of {', '.join(sorted(known))}")
        selected = {s: [c for c in cs if c.name in args.case] for s, cs in selected.items()}
        suites = [s for s in suites if selected[s]]
        if not suites:
            raise XLSTMKitError(f"no case named {', '.join(args.case)} in suite {args.suite}")
    out_dir = check_writable(args.out, "--out", folder=True) if args.out else default_out_dir()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise XLSTMKitError(f"--out {out_dir}: cannot create the folder ({e.strerror or e})") from None
    when = _dt.datetime.now(_dt.timezone.utc)
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr

    def env_of(case: registry.Case) -> Env:
        return Env(device, case.dtype(device), args.backend if case.takes_backend else None)

    limits = device_limits(device) if "ops" in suites and not args.quick else None
    rows = {s: collect(selected[s], env_of, args.quick, args.peers, log=stderr, peer_timeout_s=args.peer_timeout)
            for s in suites}
    text = report(suites, rows, device, command_line(args), args.quick, when, limits)
    path = output_path(out_dir, device, args.suite, when)
    path.write_text(text + "\n")
    print(text, file=stdout)
    print(f"\nwritten: {path}", file=stdout)
    failed = [r for s in suites for r in rows[s] if r.impl.startswith("xlstm_kit") and "status" in r.result]
    if failed:  # the table keeps the rows that did run; the command still fails
        first = failed[0]
        raise XLSTMKitError(f"{len(failed)} of our benchmark cases failed, first {first.case} "
                            f"{registry.shape_label(first.shape)}: {first.result['status']} (table in {path})")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xlstm_kit.bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        run(args)
    except ValueError as e:
        print(f"xlstm_kit.bench: error: {e}", file=sys.stderr)
        return 2
    return 0
