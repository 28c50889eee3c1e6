"""bench/vs_trl.py's table: each side's medians and the roofline."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from bench.regimes import Regime, roofline_s


def summary(results: list[dict], peak_gflops: float, bandwidth_gbs: float) -> dict:
    """Medians of the timings, means of what was sampled, the peak RSS, and (postrl's, which
    record their work) the median of the steps' rooflines; ``{"failed": why}`` if a run failed."""
    failed = [r["failed"] for r in results if "failed" in r]
    if failed:
        return {"failed": failed[0]}
    merged = {k: [v for r in results for v in r.get(k, [])]
              for k in ("step_s", "generate_s", "train_s", "loss_forward_s", "warmup_s")}
    out = {k: statistics.median(v) for k, v in merged.items() if v}
    for key in ("zero_variance", "reward", "tokens"):  # what each side sampled: means
        values = [v for r in results for v in r.get(key, [])]
        out[key] = statistics.mean(values) if values else float("nan")
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results)
    works = [w for r in results for w in r.get("work", [])]
    if works:
        out["roofline_s"] = statistics.median(
            roofline_s(w, peak_gflops, bandwidth_gbs) for w in works)
    return out


def report(regime: Regime, table: dict, own: Callable[[str, str], str]) -> None:
    """One regime's rows, its ratios and its ``REGIME: speedup=... rss_ratio=...`` line;
    ``table[setting][framework]`` is a :func:`summary`, ``own(framework, setting)`` the
    precision the framework ran in that setting."""
    print(f"\n{regime.name}: {regime.task}, at most {regime.max_new_tokens} new tokens, "
          f"reward {regime.reward}; TRL's micro-batches {regime.trl_micro_batch} rows")
    print(f"{'setting':<19}{'step s':>9}{'generate s':>12}{'train s':>9}{'peak RSS MB':>13}"
          f"{'zero-var groups':>17}{'tokens/step':>13}{'ms/token':>10}{'reward':>8}"
          f"{'roofline s':>12}{'share':>7}")
    for precision, frameworks in table.items():
        for framework, s in frameworks.items():
            setting = f"{framework} {own(framework, precision)}"
            if "failed" in s:
                print(f"{setting:<19}did not run: {s['failed']}")
                continue
            roof = (f"{s['roofline_s']:>12.2f}{s['roofline_s'] / s['step_s']:>7.0%}"
                    if "roofline_s" in s else "")
            print(f"{setting:<19}{s['step_s']:>9.2f}{s['generate_s']:>12.2f}"
                  f"{s['train_s']:>9.2f}{s['peak_rss_mb']:>13.0f}{s['zero_variance']:>17.2f}"
                  f"{s['tokens']:>13.0f}{1e3 * s['step_s'] / s['tokens']:>10.2f}"
                  f"{s['reward']:>8.3f}{roof}")
    for precision, f in table.items():
        mine = own("postrl", precision)
        print(f"postrl {mine} first (untimed) step: {f['postrl']['warmup_s']:.1f} s")
        if "failed" not in f["trl"]:
            print(f"postrl {mine} vs TRL {precision}: "
                  f"speedup={f['trl']['step_s'] / f['postrl']['step_s']:.2f} "
                  f"rss_ratio={f['postrl']['peak_rss_mb'] / f['trl']['peak_rss_mb']:.2f}")
    ran = [p for p in table if "failed" not in table[p]["trl"]]
    if not ran:
        print(f"{regime.name}: TRL did not run; postrl alone")
        return
    # each framework's fastest measured setting: TRL's is bf16 autocast on a CPU with AMX,
    # fp32 where bf16 matmuls run in fallback kernels
    theirs = table[min(ran, key=lambda p: table[p]["trl"]["step_s"])]["trl"]
    mine = table[min(table, key=lambda p: table[p]["postrl"]["step_s"])]["postrl"]
    print(f"{regime.name}: speedup={theirs['step_s'] / mine['step_s']:.2f} "
          f"rss_ratio={mine['peak_rss_mb'] / theirs['peak_rss_mb']:.2f}")
