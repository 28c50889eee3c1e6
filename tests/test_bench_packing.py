"""bench/packing_ab.py runs one batch's update both ways, from one state: responses packed,
and every response padded to its micro-batch's longest; it counts what each way computes."""

import re

from postrl.models import logprobs
from tests.bench_scripts import load_bench_script


def test_both_ways_run_padding_computes_more_columns_and_packing_is_restored(capsys,
                                                                             monkeypatch,
                                                                             tmp_path):
    monkeypatch.chdir(tmp_path)
    # a reward that varies within the tiny model's groups, so that the update trains them
    (tmp_path / "lengths.py").write_text(
        "def length(prompts, completions, **_):\n"
        "    return [float(len(str(c))) for c in completions]\n")
    vs_trl = load_bench_script("vs_trl")  # the module the script imports its run from
    monkeypatch.setattr(vs_trl, "reward_spec", lambda regime: f"{tmp_path}/lengths.py:length")
    real = logprobs.pack_responses
    load_bench_script("packing_ab").main(["--regime", "short", "--reps", "1", "--model",
                                          "tiny", "--micro-batch-size", "8"])
    printed = capsys.readouterr().out
    assert "packed / padded:" in printed
    columns = {way: int(re.search(rf"{way}: update .*; ([\d,]+) response columns",
                                  printed)[1].replace(",", ""))
               for way in ("padded", "packed")}
    assert 0 < columns["packed"] <= columns["padded"]
    assert logprobs.pack_responses is real
