"""GPT 09, 17, 25, 27, ResNet-BK 12 and Vision-BDH 10 from the step-folder code, beside the reference."""
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, os.getcwd())
out = Path(os.environ.get("OUT", "/tmp/out"))
from hwlib import notebook as nb, query
run = "verify45"
ref = json.loads(Path("outputs/reference/h100/summary.json").read_text())["workloads"]
plan = [("gpt", "09_cuda_graphs"), ("gpt", "17_fused_lm_head"), ("gpt", "25_bias_column"), ("gpt", "27_bf16_stream"),
        ("resnet_bk", "12_bk_core"), ("vit_bdh", "10_channels_last")]
t0 = time.time(); rows = []
for w, st in plan:
    if time.time() - t0 > 480:
        print(f"SKIP {w} {st}: time", flush=True); continue
    t = time.time()
    res, chk = nb.measure(w, st, notebook="verify45", profile="full", device="cuda", run=run, progress=False)
    r = next((s for s in ref[w]["steps"] if s["step"] == st), {})
    row = {"workload": w, "step": st, "status": res.status, "ms": res.timing.median_ms if res.timing else None,
           "p20": res.timing.p20_ms if res.timing else None, "p80": res.timing.p80_ms if res.timing else None,
           "ref_ms": r.get("ms_per_step"), "ref_p20": r.get("ms_p20"), "ref_p80": r.get("ms_p80"),
           "math": str(chk), "wall_s": round(time.time() - t, 1), "backends": res.op_backends}
    rows.append(row); print(json.dumps(row), flush=True)
    (out / "verify45.json").write_text(json.dumps(rows, indent=1))
import shutil
src = Path(os.environ.get("HWLIB_OUTPUTS", "outputs")) / run / "results.jsonl"
if src.exists(): shutil.copy(src, out / "results.jsonl")
print("TABLE")
for r in rows:
    print(f"{r['workload']:10s} {r['step']:18s} {r['status']:6s} new {r['ms'] and round(r['ms'],2)} ({r['p20'] and round(r['p20'],2)}-{r['p80'] and round(r['p80'],2)})  ref {r['ref_ms'] and round(r['ref_ms'],2)} ({r['ref_p20'] and round(r['ref_p20'],2)}-{r['ref_p80'] and round(r['ref_p80'],2)})  {r['wall_s']}s")
