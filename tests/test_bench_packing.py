"""bench/packing_ab.py runs one batch's update both ways, from one state: responses packed,
and every response padded to its micro-batch's longest; it counts what each way computes."""

import re

from postrl.models import logprobs
from tests.bench_scripts import load_bench_script, varying_reward


def test_both_ways_run_padding_computes_more_columns_and_packing_is_restored(capsys,
                                                                             monkeypatch,
                                                                             tmp_path):
    monkeypatch.chdir(tmp_path)
    varying_reward(monkeypatch, tmp_path)
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
