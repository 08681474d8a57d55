"""benchmarks/train_e2e.py: a crashing or hanging child costs its own row only, the kernel
categories of the profile summary, the FLOP count, the job list, and a `--quick` run end to end
on the CPU (three children, tiny shapes)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.bench.test_bench import table_rows as all_table_rows

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "train_e2e.py"


def _load():
    spec = importlib.util.spec_from_file_location("train_e2e", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


e2e = _load()


def table_rows(text: str, title: str) -> list[dict]:
    """The data rows of the markdown table under the heading `## title`."""
    section = text.split("\n## " + title, 1)[1].split("\n## ", 1)[0]
    return all_table_rows(section)


def test_child_crash_and_hang_cost_only_their_own_result():
    crash = e2e.run_child([sys.executable, "-c",
                           "print('RESULT {\"step_ms\": 1.5}', flush=True); import os; os._exit(3)"], 60)
    assert crash["rc"] == 3 and not crash["timed_out"]
    assert crash["results"] == [{"step_ms": 1.5}]  # what it printed before the crash survives
    hang = e2e.run_child([sys.executable, "-c",
                          "import time; print('RESULT {\"a\": 1}', flush=True); time.sleep(120)"], 3)
    assert hang["timed_out"] and hang["rc"] is None
    assert hang["results"] == [{"a": 1}]
    assert hang["wall_s"] < 60


@pytest.mark.parametrize("name, category", [
    ("_slstm_fwd_kernel", "slstm"),
    ("_slstm_bwd_kernel", "slstm"),
    ("_bwd_dqk", "mlstm"),
    ("_fwd_states", "mlstm"),
    ("mlstm_chunkwise__parallel_fw_H_kernel", "mlstm"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("triton_tem_fused_mm_3", "gemm"),
    ("triton_poi_fused_add_mul_sigmoid_0", "elementwise"),
    ("triton_red_fused__to_copy_native_layer_norm_1", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >", "elementwise"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "elementwise"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>", "attention"),
    ("void cudnn::something_unusual", "other"),
])
def test_kernel_category(name, category):
    assert e2e.kernel_category(name) == category


def test_profile_summary_per_step():
    events = [("_slstm_fwd_kernel", 30.0, 6.0), ("_bwd_dqk", 10.0, 48.0), ("nvjet_gemm", 50.0, 200.0),
              ("triton_poi_fused_add_0", 10.0, 1000.0)]
    s = e2e.summarize_kernels(events, n_steps=2, top=2)
    assert s["launches_per_step"] == pytest.approx(627.0)
    assert s["kernel_ms_per_step"] == pytest.approx(50.0)
    assert s["category_ms"]["slstm"] == pytest.approx(15.0) and s["category_ms"]["other"] == 0.0
    assert s["category_share"]["gemm"] == pytest.approx(0.5)
    assert sum(s["category_share"].values()) == pytest.approx(1.0)
    assert [t["name"] for t in s["top"]] == ["nvjet_gemm", "_slstm_fwd_kernel"]


def test_flops_per_token_matches_the_registry_count():
    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
    from xlstm_kit.bench.registry import flops_per_token

    cfg = XLSTMConfig(vocab_size=1000, d_model=64, n_blocks=8, n_heads=4, slstm_at="7:1")
    with torch.device("meta"):
        model = XLSTMLanguageModel(cfg)
    k = cfg.mlstm_inner_dim // cfg.n_heads
    n_m = cfg.block_types.count("m")
    ours = 6.0 * e2e.matmul_params(model) + e2e.mlstm_flops(n_m, cfg.n_heads, k, k, cfg.chunk_size)
    assert ours == pytest.approx(flops_per_token(cfg))
    # the embedding table is a lookup: not in N, the head is
    assert e2e.matmul_params(model) < sum(p.numel() for p in model.parameters()) - model.embedding.weight.numel() + 1
    assert e2e.attention_flops(12, 768, 2048) == 3 * 12 * 2 * 768 * 2048


def test_job_list_order_checkpointing_and_unknown_names():
    names = [j[0] for j in e2e.job_list(None, "off")]
    assert names[0] == "tf_compile" and set(names) == set(e2e.JOBS)
    both = e2e.job_list(None, "both")
    ckpt = [n for n, _, st, _ in both if st.get("ckpt")]
    assert ckpt == [n + "_ckpt" for n in names if e2e.JOBS[n][1].get("arch") in e2e.XLSTM_ARCHS]
    on = e2e.job_list("tf_eager,x71_eager", "on")
    assert [(n, st.get("ckpt", False)) for n, _, st, _ in on] == [("tf_eager", False), ("x71_eager", True)]
    assert e2e.job_list("x10_eager_ckpt", "off")[0][2]["ckpt"] is True
    with pytest.raises(SystemExit):
        e2e.job_list("x10_eager,nope", "off")


def test_budget_spent_skips_every_job_with_a_note(tmp_path):
    assert e2e.main(["--quick", "--budget-s", "0", "--only", "tf_eager,slstm_ops", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "train_e2e.md").read_text()
    rows = table_rows(md, "Models")
    assert [r["job"] for r in rows] == ["tf_eager"] and "skipped" in md
    assert "slstm_ops: skipped" in md and (tmp_path / "train_e2e.jsonl").read_text() == ""


def test_quick_run_times_each_job_in_a_child(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--quick", "--steps", "1",
           "--only", "tf_eager,x71_eager,slstm_ops", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    md = (tmp_path / "train_e2e.md").read_text()
    # the tables are printed last (the device reply keeps the end of the output)
    models_table = md[md.index("## Models"):md.index("## Ops")].strip()
    assert r.stdout.rstrip().endswith(md[md.index("## Ops"):md.index("## Top kernels")].strip())
    assert models_table in r.stdout
    rows = {row["job"]: row for row in table_rows(md, "Models")}
    assert set(rows) == {"tf_eager", "x71_eager"}
    assert rows["tf_eager"]["× TF"] == "1.00"  # no compiled Transformer here: the eager one is the reference
    for row in rows.values():
        assert float(row["tokens/s"].replace(",", "")) > 0 and row["loss ok"] == "yes"
    raw = [json.loads(line) for line in (tmp_path / "train_e2e.jsonl").read_text().splitlines()]
    models = {x["job"]: x for x in raw if x.get("kind") == "model"}
    assert models["x71_eager"]["block_types"] == "ms"
    assert models["x71_eager"]["params"] > models["x71_eager"]["matmul_params"] > 0
    assert all(m["tok_s"] > 0 and m["flops_per_token"] > 0 and m["loss_finite"] for m in models.values())
    for m in models.values():  # the profile summary (ATen ops on the CPU)
        assert m["profile"]["launches_per_step"] > 0 and m["profile"]["top"]
        assert sum(m["profile"]["category_share"].values()) == pytest.approx(1.0)
    assert float(rows["x71_eager"]["launches/step"].replace(",", "")) == pytest.approx(
        models["x71_eager"]["profile"]["launches_per_step"], abs=1)
    ops = [x for x in raw if x.get("kind") == "op"]
    assert [x["op"] for x in ops] == ["slstm_recurrent"] and ops[0]["fwbw_ms"] > 0
